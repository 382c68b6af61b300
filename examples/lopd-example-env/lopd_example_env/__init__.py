"""An example LOPD environment plugin (entry point `library` of group `lopd.envs`): see library.py."""

from .library import LibraryEnv

__all__ = ["LibraryEnv"]
