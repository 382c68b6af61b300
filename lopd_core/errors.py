"""Errors about what a run found on disk, whose message is the whole story: the command line prints it, no traceback.

Why a class of its own: a corrupt checkpoint, a checkpoint made under other settings or an unreadable bank file is
not a bug in the code but a state the user has to act on (start over, restore a file, change a setting). The
message names the file and that action; a traceback would only bury it. Imports nothing, so the command line can
catch these without loading the library.
"""


class StateError(Exception):
    """A file a run depends on (checkpoint, bank) cannot be used as it is; the message names it and the fix."""
