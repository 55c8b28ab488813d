"""DCIR's runtime (imported as ``dcir_runtime``): the C++ collectives and shard store
(``native``), and the training ``Engine`` built on them (``engine``)."""

from dcir_runtime.config import Config, parse_bytes
from dcir_runtime.engine import Engine, RankFailure, initialize

__all__ = ["Config", "Engine", "RankFailure", "initialize", "parse_bytes"]
