"""DCIR's runtime (imported as ``dcir_runtime``): the C++ collectives and shard store
(``native``), the training ``Engine`` built on them (``engine``), and its checkpoints
(``checkpoint``)."""

from dcir_runtime.config import Config, parse_bytes
from dcir_runtime.engine import Engine, RankFailure, initialize
from dcir_runtime.checkpoint import export as export_checkpoint

__all__ = ["Config", "Engine", "RankFailure", "export_checkpoint", "initialize", "parse_bytes"]
