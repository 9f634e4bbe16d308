"""Checkpoint tensors that are read only when, and only as far as, a weight loader needs them.

Under tensor parallelism each rank keeps a slice of most weights: some rows (column-parallel layers, the vocabulary)
or some columns (row-parallel layers). A checkpoint reader yields a ``LazyTensor`` (shape and dtype known, nothing
read); the parallel layers' weight loaders ``narrow`` it to their rank's part, which costs nothing, and only then
``materialize`` it, so the reader reads (and, for GGUF, copies and dequantizes) that part alone.

Everything else sees plain tensors: ``Checkpoint.weights()`` materializes each one whole, which is what world size 1
loads, and ``load_weights_by_name`` does the same for a parameter whose loader is not marked ``lazy_aware``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# (start, length) per dimension of the full tensor: the part a LazyTensor stands for
Box = tuple[tuple[int, int], ...]


class LazyTensor:
    """A part (at first the whole) of a checkpoint tensor, not read yet. ``reader(box)`` returns that part of the
    full tensor as a torch.Tensor of the box's lengths; it may be a view of a file mapping (safetensors: the copy into
    the parameter is then the only read) or a fresh tensor (GGUF rows dequantized)."""

    __slots__ = ("shape", "dtype", "box", "reader")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, reader: Callable[[Box], torch.Tensor],
                 box: Box | None = None):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.box = tuple((0, n) for n in self.shape) if box is None else box
        self.reader = reader

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """``torch.narrow``'s part, still unread."""
        dim = dim + self.dim() if dim < 0 else dim
        if not (0 <= dim < self.dim() and 0 <= start and length >= 0 and start + length <= self.shape[dim]):
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape {tuple(self.shape)}")
        box = list(self.box)
        box[dim] = (box[dim][0] + start, length)
        shape = list(self.shape)
        shape[dim] = length
        return LazyTensor(shape, self.dtype, self.reader, tuple(box))

    def chunk(self, chunks: int, dim: int = 0) -> list[LazyTensor]:
        """``torch.chunk``'s parts (each ``ceil(size / chunks)`` long, the last shorter)."""
        size = self.shape[dim]
        step = -(-size // chunks)
        return [self.narrow(dim, start, min(step, size - start)) for start in range(0, size, step)]

    def materialize(self) -> torch.Tensor:
        """Read the part: a tensor of ``shape``."""
        out = self.reader(self.box)
        if out.shape != self.shape:   # a reader's bug would otherwise surface as a wrong weight
            raise RuntimeError(f"checkpoint reader returned shape {tuple(out.shape)} for a part of shape "
                               f"{tuple(self.shape)}")
        return out

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype}, box={self.box})"


def materialize(tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    """The tensor itself, or a LazyTensor read."""
    return tensor.materialize() if isinstance(tensor, LazyTensor) else tensor


def view_reader(tensor: torch.Tensor) -> Callable[[Box], torch.Tensor]:
    """A reader of parts of a tensor that is already there (or a view of a file mapping): slicing, no copy."""
    def read(box: Box) -> torch.Tensor:
        return tensor[tuple(slice(start, start + length) for start, length in box)]

    return read


def lazy_aware(loader):
    """Marks a weight loader that narrows a LazyTensor before materializing it: ``load_weights_by_name`` hands such
    a loader the lazy tensor, and any other loader the tensor read whole (what a loader that predates lazy tensors
    expects). Works on functions, methods (decorate the function) and ``functools.partial`` objects."""
    loader.lazy_aware = True
    return loader


def takes_lazy(loader) -> bool:
    return getattr(loader, "lazy_aware", False)
