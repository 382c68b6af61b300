"""Files domain: small text files in folders, with locks and a trash.

Conventions: ``lock_writes`` (writing a file that is not locked is "rejected"; a file left
locked fails the task silently), ``remove_tool`` (files_delete vs files_trash leave different
states: silent failure), ``folder_style`` (folder arguments "notes" vs "/notes"; the wrong
style is "rejected").
"""

from __future__ import annotations

import re

from ..tools import ToolError, tool
from . import Domain

TRASH = "trash"


class Files(Domain):
    name = "files"

    def _folder(self, text: str) -> str:
        pattern = r"[a-z]+" if self.conv["folder_style"] == "plain" else r"/[a-z]+"
        if not re.fullmatch(pattern, text) or text.lstrip("/") == TRASH:
            raise ToolError("rejected")
        return text.lstrip("/")

    def _file(self, file: str) -> dict:
        f = self.lookup(self.state["files"], file)
        if f["folder"] == TRASH:
            raise ToolError("not found")
        return f

    @tool
    def files_list(self, folder: str) -> list:
        """List the files in a folder.

        Args:
            folder: folder name
        """
        folder = self._folder(folder)
        return [{"id": k, "name": f["name"]} for k, f in self.state["files"].items() if f["folder"] == folder][:4]

    @tool
    def files_read(self, file: str) -> dict:
        """Read a file.

        Args:
            file: file id
        """
        return {"id": file, "content": self._file(file)["content"]}

    @tool
    def files_write(self, file: str, content: str) -> dict:
        """Replace the content of a file.

        Args:
            file: file id
            content: new text
        """
        f = self._file(file)
        if self.conv["lock_writes"] and not f["locked"]:
            raise ToolError("rejected")
        f["content"] = content
        return {"id": file, "status": "written"}

    @tool
    def files_lock(self, file: str) -> dict:
        """Lock a file for editing.

        Args:
            file: file id
        """
        self._file(file)["locked"] = True
        return {"id": file, "locked": True}

    @tool
    def files_unlock(self, file: str) -> dict:
        """Unlock a file.

        Args:
            file: file id
        """
        self._file(file)["locked"] = False
        return {"id": file, "locked": False}

    @tool
    def files_create(self, folder: str, name: str, content: str) -> dict:
        """Create a new file.

        Args:
            folder: folder name
            name: file name
            content: text
        """
        folder = self._folder(folder)
        if not name.strip() or any(f["name"] == name and f["folder"] == folder for f in self.state["files"].values()):
            raise ToolError("rejected")
        file = self.new_id("f", self.state["files"])
        self.state["files"][file] = {"name": name, "folder": folder, "content": content, "locked": False}
        return {"id": file}

    @tool
    def files_delete(self, file: str) -> dict:
        """Delete a file permanently.

        Args:
            file: file id
        """
        self._file(file)
        del self.state["files"][file]
        return {"id": file, "status": "deleted"}

    @tool
    def files_trash(self, file: str) -> dict:
        """Move a file to the trash.

        Args:
            file: file id
        """
        self._file(file)["folder"] = TRASH
        return {"id": file, "status": "trashed"}

    @tool
    def files_move(self, file: str, folder: str) -> dict:
        """Move a file to another folder.

        Args:
            file: file id
            folder: destination folder
        """
        f = self._file(file)
        f["folder"] = self._folder(folder)
        return {"id": file, "status": "moved"}
