"""Runs the README's ```python blocks, as written, on real ranks (used by tests/test_readme.py).

A block runs in a namespace of its own, with a small preamble standing in for what a training
script already has (:func:`preamble`): ``net``, ``model``, ``loader``, ``loss_fn``,
``optimizer`` (DDP) or ``opt`` (Horovod), ``rank``, ``ddp_model``. Imports are the block's own. A block
that mentions Horovod runs under ``horovodrun``; every other block on a DDP Gloo group.

Opting out: a block whose first line is ``# readme-test: skip -- <why>`` is not run; the reason
is required, and the test reports it.

Run as a script under horovodrun (``python tests/readme_worker.py OUT_DIR``) it runs the Horovod
blocks; :func:`run_ddp_blocks` is the DDP ranks' worker for :func:`multiprocess.spawn`.
"""
from __future__ import annotations

import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

README = Path(__file__).resolve().parent.parent / "README.md"
OPT_OUT = re.compile(r"#\s*readme-test:\s*skip\b\s*(?:--|:|-)?\s*(?P<reason>.*)")


@dataclass(frozen=True)
class Block:
    line: int  # of the first line of code, 1-based
    code: str

    @property
    def opt_out_reason(self) -> Optional[str]:
        """The reason after ``# readme-test: skip``; ``""`` if the marker gives none; ``None``: runs."""
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        match = OPT_OUT.match(first.strip())
        return None if match is None else match.group("reason").strip()

    @property
    def kind(self) -> str:
        """``horovod``, ``accelerate`` and ``hf_trainer`` blocks need their own launcher (tests/test_readme.py
        runs the first, tests/test_accelerate.py and tests/test_hf_trainer.py the others); the rest: ``ddp``."""
        if re.search(r"\bhorovod\b|\bhvd\.", self.code):
            return "horovod"
        if re.search(r"^from accelerate import|^import accelerate", self.code, re.M):
            return "accelerate"
        if re.search(r"^from transformers import|^import transformers", self.code, re.M):
            return "hf_trainer"
        return "ddp"

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def python_blocks(path: Path = README) -> List[Block]:
    """Every fenced block opened by exactly ```python, in order."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = line.strip()
        if current is None and fence == "```python":
            current, start = [], number + 1
        elif current is not None and fence.startswith("```"):
            blocks.append(Block(start, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        raise ValueError(f"README.md: the ```python block at line {start - 1} is never closed")
    return blocks


def example(name: str, path: Path = README) -> str:
    """The ```python block between ``<!-- example: NAME -->`` and ``<!-- /example: NAME -->``."""
    block = path.read_text().split(f"<!-- example: {name} -->", 1)[1].split(f"<!-- /example: {name} -->", 1)[0]
    return block.split("```python", 1)[1].split("```", 1)[0]


class TinyNet(torch.nn.Module):
    """A stand-in for the reader's model: big enough for top-k and 2-bit to compress (min_numel)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(32, 64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def preamble(block: Block, rank: int) -> Dict[str, object]:
    """What a training script has before the block's lines: a model, data, a loss, an optimizer,
    this rank's index. No imports: a block imports what it uses, so it runs when copied. Objects
    the block names only (``ddp_model``), so that no model is wrapped twice."""
    torch.manual_seed(0)  # the same initial model on every rank, as after a broadcast
    net = TinyNet()
    generator = torch.Generator().manual_seed(100 + rank)  # different data per rank
    loader = [(torch.randn(16, 32, generator=generator), torch.randn(16, 4, generator=generator)) for _ in range(4)]
    names: Dict[str, object] = {"rank": rank, "net": net, "model": net, "loader": loader,
                                "loss_fn": torch.nn.functional.mse_loss}  # fmt: skip
    if block.kind == "horovod":
        names["opt"] = torch.optim.SGD(net.parameters(), lr=0.05)
    else:
        names["optimizer"] = torch.optim.SGD(net.parameters(), lr=0.05)
        if re.search(r"\bddp_model\b", block.code):
            names["ddp_model"] = torch.nn.parallel.DistributedDataParallel(net)
    return names


def run_block(block: Block, rank: int) -> Optional[str]:
    """Run ``block`` in a fresh namespace; ``None`` if it ran, else its traceback."""
    namespace = preamble(block, rank)
    try:
        exec(compile(block.code, block.name, "exec"), namespace)
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        return traceback.format_exc()
    return None


def run_blocks(kind: str, rank: int, out_dir: str) -> Dict[str, Optional[str]]:
    """Run every block of ``kind`` that does not opt out, in README order, with ``out_dir`` as
    the working directory (blocks may write checkpoints)."""
    os.chdir(out_dir)
    return {b.name: run_block(b, rank) for b in python_blocks() if b.kind == kind and b.opt_out_reason is None}


def run_ddp_blocks(rank: int, world_size: int, out_dir: str) -> Dict[str, Optional[str]]:
    """The DDP ranks' worker (``multiprocess.spawn(..., pass_out_dir=True)``)."""
    torch.set_num_threads(1)
    return run_blocks("ddp", rank, out_dir)


def main(out_dir: str) -> None:
    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    results = run_blocks("horovod", hvd.rank(), out_dir)
    torch.save(results, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
