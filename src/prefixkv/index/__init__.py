"""The index: which full blocks can be found by their content.

``Index`` is the protocol the manager and pool use; ``ContentIndex`` is the prefix cache
(content-keyed, verified by construction); ``NoIndex`` never finds anything (plain paged
allocation, ``enable_caching=False``).
"""

from .content import ContentIndex
from .hasher import Hasher
from .none import NoIndex
from .protocol import Index

__all__ = ["ContentIndex", "Hasher", "Index", "NoIndex"]
