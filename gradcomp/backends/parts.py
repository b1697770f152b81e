"""The chunk-scaled quantizers' and top-k's compress over every part of one flat group at once.

A per-parameter payload (:class:`~gradcomp.compressors.PerParameter`) holds one quantizer payload per parameter
of a group, each its codes then its scales, every segment 8-byte aligned. Called part by part, each op pays its
fixed cost (argument checks, NumPy views of the tensors, the kernel lock, a payload allocated and copied into
place) once per parameter, and on a small model that cost is the step: on the digits MLP of the convergence
study under the recipe's 3-bit code, the engine took about as long as the model's compute (the in-process
simulation, one thread; an informal timing, not a quiet one). A batched form pays it once per group and
slices the group's arrays per part; the study's step times (README, "Sooner?") show what it changed.

Signatures (``words``: the payload buffer viewed as int32, ``[nbytes / 4]``; ``parts``: :class:`Part` rows,
the compressed parameters only)::

    compress        fn(grad, residual_in, residual_out, words, parts, divisor=None)
                                                                        writes the parts' codes and scales
    decompress_add  fn(words, parts, out)                               out[lo : lo + numel] += decoded
    average         fn(words, parts, out, multiplier=None, dense=None)  (``words`` int32 ``[P, W]``, one payload a row)
                    out[lo : lo + numel] = (0 + D_0 + ... + D_{P-1}) / P   (times ``multiplier[lo : lo + numel]``)
                    and out[elements] = (0 + v_0 + ... + v_{P-1}) / P (times ``multiplier[elements]``)
                    for ``dense = (values [P, X], elements, slots)``: ``v_r = float32(values[r, slots])``, int64
                    indices, the parts a group sends whole
    topk_compress   fn(grad, residual_in, residual_out, values, indices, parts)   (``parts``: :class:`Selection`)

Tensors and conventions are the per-part op's (:mod:`gradcomp.backends`), over the whole group: ``grad``,
the residuals and ``out`` are ``[n]``; part ``i`` reads and writes elements ``[lo, lo + numel)``, its codes
are ``words[codes : codes + ceil(numel / per_word)]`` and its scales the float32 view of
``words[scales : scales + ceil(numel / chunk)]``; top-k's part ``i`` selects its ``k`` entries into
``values[first : first + k]`` and ``indices[first : first + k]`` (its own positions, as the per-part op
gives them). A quantizer's compress given a ``divisor`` (float32 ``[n]``, not mutated) compresses
``acc = float32(grad) / divisor + residual_in``, bitwise the op on ``grad`` divided first: Adam's stage exchanges
its update units without a divided copy of the gradient (a fused kernel divides as it loads). Every part is
checked to lie inside the arrays before anything is written. An average writes each part's elements (the rank-ordered
float32 sum of the decodes from +0.0, divided by ``P``, then times the multiplier: the engine's unfused order) and no
other; it returns whether every element it wrote is finite, or ``None`` where the form does not say (the looped one).
The results are bitwise the per-part op's: the
batched forms run the same kernels on the same slices (top-k's numba form, the same kernel's steps on each part's
elements of the group's arrays).

:func:`parts_valid` is the received payload's check, the quantizers' ``check_payload`` rules over every part
in a few reductions; a payload it rejects is checked again part by part, which names the part and the fault.
Top-k's forms are in :mod:`gradcomp.backends.sparse_parts`.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence, Tuple

import torch

from gradcomp.validation import within

__all__ = ["Part", "Selection", "PartIndex", "geometry", "spans", "check_parts", "check_selections", "looped",
           "average_dense", "part_index", "parts_valid"]


class Part(NamedTuple):
    """One compressed parameter of a group: its elements and where its segments start in ``words``."""
    lo: int  # first element in the group
    numel: int
    codes: int  # first int32 word of its codes
    scales: int  # first int32 word of its float32 scales


class Selection(NamedTuple):
    """One top-k part of a group: its elements and where its ``k`` entries go in the group's selection."""
    lo: int  # first element in the group
    numel: int
    first: int  # first entry in values and indices
    k: int  # 1 <= k <= numel


#: Per family: codes per int32 word, elements per scale, bits per code.
_GEOMETRY = {"threebit": (10, 128, 3), "twobit_chunk": (16, 64, 2)}


def geometry(op: str) -> Tuple[int, int, int]:
    """``(codes per word, elements per scale, bits per code)`` of ``op``'s family."""
    return _GEOMETRY[op.replace("_decompress_add", "").replace("_compress", "").replace("_average", "")]


def spans(op: str, part: Part) -> Tuple[slice, slice]:
    """The int32 words of ``part``'s codes and of its scales under ``op``'s family."""
    per_word, chunk, _ = geometry(op)
    return (slice(part.codes, part.codes + -(-part.numel // per_word)),
            slice(part.scales, part.scales + -(-part.numel // chunk)))


def check_parts(op: str, parts: Sequence[Part], n: int, words: int) -> None:
    """Raise ``ValueError`` unless every part lies in ``[0, n)`` and its codes and scales in ``words`` words."""
    for index, part in enumerate(parts):
        codes, scales = spans(op, part)
        if not (0 <= part.lo and 0 < part.numel and part.lo + part.numel <= n and 0 <= part.codes
                and 0 <= part.scales and codes.stop <= words and scales.stop <= words):
            raise ValueError(f"{op}: part {index} {tuple(part)} does not fit {n} elements and {words} words")


def check_selections(op: str, parts: Sequence[Selection], n: int, entries: int) -> None:
    """Raise ``ValueError`` unless every part lies in ``[0, n)`` and its ``1 <= k <= numel`` entries in ``entries``."""
    for index, part in enumerate(parts):
        if not (0 <= part.lo and 0 < part.numel and part.lo + part.numel <= n and 0 <= part.first
                and 1 <= part.k <= part.numel and part.first + part.k <= entries):
            raise ValueError(f"{op}: part {index} {tuple(part)} does not fit {n} elements and {entries} entries")


def looped(op: str, fn: Callable) -> Callable:
    """``op``'s batched signature over ``fn``, the per-part op, called part by part (every backend's form
    where it has no batched one)."""

    def segments(words, part):
        codes, scales = spans(op, part)
        return words[codes], words[scales].view(torch.float32)

    if op == "topk_compress":
        def select(grad, residual_in, residual_out, values, indices, parts):
            check_selections(op, parts, grad.numel(), values.numel())
            for part in parts:
                piece, entries = slice(part.lo, part.lo + part.numel), slice(part.first, part.first + part.k)
                fn(grad[piece], None if residual_in is None else residual_in[piece],
                   None if residual_out is None else residual_out[piece], values[entries], indices[entries])
        return select

    if op.endswith("_compress"):
        def compress(grad, residual_in, residual_out, words, parts, divisor=None):
            check_parts(op, parts, grad.numel(), words.numel())
            if divisor is not None:  # the same float32 division a fused kernel does as it loads
                grad = grad.float() / divisor
            for part in parts:
                piece = slice(part.lo, part.lo + part.numel)
                fn(grad[piece], None if residual_in is None else residual_in[piece],
                   None if residual_out is None else residual_out[piece], *segments(words, part))
        return compress

    if op.endswith("_average"):
        def average(words, parts, out, multiplier=None, dense=None):
            check_parts(op, parts, out.numel(), words.shape[-1])
            for part in parts:
                piece = slice(part.lo, part.lo + part.numel)
                own = out[piece].zero_()
                for row in words:
                    fn(*segments(row, part), own)
                own.div_(words.shape[0])
                if multiplier is not None:
                    own.mul_(multiplier[piece])
            if dense is not None:
                average_dense(*dense, out, multiplier)
            return None
        return average

    def decompress_add(words, parts, out):
        check_parts(op, parts, out.numel(), words.numel())
        for part in parts:
            fn(*segments(words, part), out[part.lo: part.lo + part.numel])
    return decompress_add


def average_dense(values: torch.Tensor, elements: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                  multiplier=None) -> None:
    """``out[elements] = (0 + v_0 + ... + v_{P-1}) / P`` (times ``multiplier[elements]``), ``v_r`` the float32 of
    ``values[r, slots]`` (``values`` ``[P, X]``; ``out`` is mutated): the decode's rank-ordered float32 sum."""
    acc = torch.zeros(elements.numel(), dtype=torch.float32, device=out.device)
    for row in values.index_select(1, slots):
        acc += row.float()
    acc.div_(values.shape[0])
    if multiplier is not None:
        acc.mul_(multiplier.index_select(0, elements))
    out.index_copy_(0, elements, acc)


class PartIndex(NamedTuple):
    """Where a group's compressed parts keep their words (int32 positions in ``words``), for :func:`parts_valid`."""
    codes: torch.Tensor  # every code word
    last: torch.Tensor  # each part's last code word, where it is partly used
    shifts: torch.Tensor  # int32: the bits that last word uses
    scales: torch.Tensor  # every scale
    spare: int  # bits of every word past its codes (3-bit: 2)
    code_runs: torch.Tensor  # int64 [parts, 2]: each part's code words, [start, stop) (the runs of codes)
    scale_runs: torch.Tensor  # int64 [parts, 2]: each part's scales, [start, stop)

    def to(self, device) -> "PartIndex":
        return PartIndex(*(column.to(device) for column in self[:4]), self.spare,
                         *(column.to(device) for column in self[5:]))


def part_index(op: str, parts: Sequence[Part]) -> PartIndex:
    """The :class:`PartIndex` of ``parts`` under ``op``'s family (built once per layout)."""
    per_word, chunk, bits = geometry(op)
    codes, scales, last, shifts, code_runs, scale_runs = [], [], [], [], [], []
    for part in parts:
        count, scale_count = -(-part.numel // per_word), -(-part.numel // chunk)
        codes.append(torch.arange(part.codes, part.codes + count))
        scales.append(torch.arange(part.scales, part.scales + scale_count))
        code_runs.append((part.codes, part.codes + count))
        scale_runs.append((part.scales, part.scales + scale_count))
        if part.numel % per_word:
            last.append(part.codes + count - 1)
            shifts.append(bits * (part.numel % per_word))
    # int32 positions (a payload is far under 2^31 words): the index is kept with the plan, 0.4 bytes an element
    # for the 3-bit code.
    empty = torch.zeros(0, dtype=torch.int32)
    return PartIndex(torch.cat(codes).int() if codes else empty, torch.tensor(last, dtype=torch.int32),
                     torch.tensor(shifts, dtype=torch.int32), torch.cat(scales).int() if scales else empty,
                     32 - bits * per_word, torch.tensor(code_runs, dtype=torch.int64).reshape(-1, 2),
                     torch.tensor(scale_runs, dtype=torch.int64).reshape(-1, 2))


def parts_valid(words: torch.Tensor, index: PartIndex) -> bool:
    """Whether every part passes its quantizer's ``check_payload`` (``words``: int32, not mutated): no code
    word sets a spare bit, no last word a bit past its part's end, and every scale is finite and >= 0.

    A backend's own form runs where it has one (:func:`~gradcomp.backends.form_kernel`): on the CPU these
    torch ops copy every code word out by ``index_select`` before a reduction reads them, two passes and a dozen
    dispatches per payload, where one loop reads each word once."""
    from gradcomp.backends import form_kernel  # the registry imports this module's users

    fast = form_kernel("check", "parts_valid", words.device)
    if fast is not None:
        return fast(words, index)
    if index.spare and not within(words.index_select(0, index.codes), 0, (1 << (32 - index.spare)) - 1):
        return False
    # Arithmetic shifts: a word with bit 31 set stays non-zero, as the unsigned test wants.
    if index.last.numel() and bool(((words.index_select(0, index.last) >> index.shifts) != 0).any()):
        return False
    return within(words.view(torch.float32).index_select(0, index.scales), 0, torch.finfo(torch.float32).max)
