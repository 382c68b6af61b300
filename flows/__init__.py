"""The Prefect flows: the cycle, the comparison and one flow per stage, over the tasks in tasks/."""
