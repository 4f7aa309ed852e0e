"""What running a node produces, and how it fails: shared by the real and the simulated runner.

Torch-free, so a process of simulated executors never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.errors import T2IError
from libs.protocol.messages import NodeTiming
from libs.protocol.tensor_meta import TensorMeta


class NodeError(T2IError):
    """A node failed; ``retryable`` says whether running it again (anywhere) can help."""

    def __init__(self, message: str, retryable: bool = False, unreachable: str = "") -> None:
        super().__init__(message)
        self.retryable = retryable
        self.unreachable = unreachable  # the producer whose tensor could not be read, if that is why


@dataclass
class Png:
    data: bytes
    width: int
    height: int


@dataclass
class NodeOutcome:
    outputs: dict[str, TensorMeta | list[TensorMeta]]
    pngs: dict[str, Png]
    timing: NodeTiming
    bytes_in: int
    reads: list[TensorMeta] = field(default_factory=list)  # inputs to release at their producers
