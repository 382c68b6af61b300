"""Shop domain: a small catalogue with stock, orders and a cart.

Conventions: ``order_flow`` (an order made through the other path — shop_place_order vs
shop_add_to_cart + shop_checkout — is recorded with the wrong channel: silent failure),
``confirm_orders`` (an order left pending is a silent failure; confirming where orders need
no confirmation is "rejected").
"""

from __future__ import annotations

from ..tools import ToolError, tool
from . import Domain


class Shop(Domain):
    name = "shop"

    def _new_order(self, items: list[dict], channel: str) -> dict:
        products = self.state["products"]
        for it in items:
            self.lookup(products, it["product"])
        need: dict[str, int] = {}
        for it in items:
            need[it["product"]] = need.get(it["product"], 0) + it["qty"]
        if any(q < 1 or q > products[p]["stock"] for p, q in need.items()):
            raise ToolError("rejected")
        for p, q in need.items():
            products[p]["stock"] -= q
        order = self.new_id("o", self.state["orders"])
        status = "pending" if self.conv["confirm_orders"] else "confirmed"
        self.state["orders"][order] = {"items": items, "status": status, "channel": channel}
        return {"order": order}

    @tool
    def shop_search(self, query: str) -> list:
        """Search products by name.

        Args:
            query: words in the product name
        """
        q = query.strip().lower()
        if not q:
            raise ToolError("rejected")
        hits = [(k, v) for k, v in self.state["products"].items() if q in v["name"]]
        return [{"id": k, "name": v["name"], "price": v["price"]} for k, v in hits][:4]

    @tool
    def shop_get_product(self, product: str) -> dict:
        """Details and stock of a product.

        Args:
            product: product id
        """
        v = self.lookup(self.state["products"], product)
        return {"id": product, "name": v["name"], "price": v["price"], "stock": v["stock"]}

    @tool
    def shop_place_order(self, product: str, qty: int) -> dict:
        """Order a product directly.

        Args:
            product: product id
            qty: quantity
        """
        return self._new_order([{"product": product, "qty": qty}], "direct")

    @tool
    def shop_add_to_cart(self, product: str, qty: int) -> dict:
        """Put a product in the cart.

        Args:
            product: product id
            qty: quantity
        """
        v = self.lookup(self.state["products"], product)
        if qty < 1 or qty > v["stock"]:
            raise ToolError("rejected")
        self.state["cart"].append({"product": product, "qty": qty})
        return {"cart": len(self.state["cart"])}

    @tool
    def shop_checkout(self) -> dict:
        """Order everything in the cart."""
        if not self.state["cart"]:
            raise ToolError("rejected")
        out = self._new_order(list(self.state["cart"]), "cart")
        self.state["cart"] = []
        return out

    @tool
    def shop_confirm_order(self, order: str) -> dict:
        """Confirm a pending order.

        Args:
            order: order id
        """
        o = self.lookup(self.state["orders"], order)
        if not self.conv["confirm_orders"] or o["status"] != "pending":
            raise ToolError("rejected")
        o["status"] = "confirmed"
        return {"order": order, "status": "confirmed"}

    @tool
    def shop_cancel_order(self, order: str) -> dict:
        """Cancel an order.

        Args:
            order: order id
        """
        o = self.lookup(self.state["orders"], order)
        if o["status"] == "cancelled":
            raise ToolError("rejected")
        o["status"] = "cancelled"
        for it in o["items"]:
            self.state["products"][it["product"]]["stock"] += it["qty"]
        return {"order": order, "status": "cancelled"}

    @tool
    def shop_list_orders(self) -> list:
        """Your latest orders, newest first."""
        rows = []
        for k, o in reversed(list(self.state["orders"].items())):
            first = self.state["products"][o["items"][0]["product"]]["name"]
            rows.append({"id": k, "product": first, "status": o["status"]})
        return rows[:4]
