"""The received payload's check over a group's parts: the numba form accepts exactly what the torch form accepts."""
import pytest
import torch

import gradcomp
import gradcomp.backends
from gradcomp.backends import form_kernel
from gradcomp.compressors.per_parameter import PerParameter

pytest.importorskip("numba", reason="the numba form needs numba")

NUMELS = (3000, 10, 5000, 1, 2048, 7, 1500, 1281)  # parts whose last code word is partly used, and dense ones
DENSE_BELOW = 1024


def _group(spec):
    grouped = PerParameter(gradcomp.from_spec(spec), NUMELS, dense_below=DENSE_BELOW)
    payload = grouped.compress(torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(3)))
    return payload.buffer.view(torch.int32), grouped._on(grouped._plan(torch.float32).index, torch.device("cpu"))


def _forms(monkeypatch):
    """``(torch form, numba form)`` of ``parts_valid``, both through :func:`gradcomp.backends.parts.parts_valid`."""
    from gradcomp.backends.parts import parts_valid

    def under(backend):
        def check(words, index):
            monkeypatch.setenv(gradcomp.backends.ENV_VAR, backend)
            return parts_valid(words, index)
        return check
    return under("torch"), under("numba")


def test_the_numba_form_is_registered_and_chosen_on_the_cpu(monkeypatch):
    from gradcomp.backends.numba import part_check

    monkeypatch.setenv(gradcomp.backends.ENV_VAR, "numba")
    assert form_kernel("check", "parts_valid", torch.device("cpu")) is part_check.parts_valid
    monkeypatch.setenv(gradcomp.backends.ENV_VAR, "torch")
    assert form_kernel("check", "parts_valid", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="unknown 'check' form 'parts_sum'"):
        form_kernel("check", "parts_sum", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown 'checks' form"):
        form_kernel("checks", "parts_valid", torch.device("cpu"))


@pytest.mark.parametrize("spec", ["threebit", "twobit:chunk"])
def test_both_forms_judge_every_corruption_alike(spec, monkeypatch):
    """Each word of the payload set to values that break a rule (a spare bit, a bit past a part's end, a negative,
    infinite or NaN scale) or keep them: the two forms agree on every one, and both reject and accept some."""
    words, index = _group(spec)
    torch_form, numba_form = _forms(monkeypatch)
    assert torch_form(words, index) and numba_form(words, index)
    patterns = [-1, 1 << 30, -(1 << 31), 0x40000001, 0x7F800000, 0x7FC00000,
                0xFF800000 - (1 << 32), 3 << 28, 1, 0, 0x3F800000]
    verdicts = []
    for word in range(words.numel()):
        for pattern in patterns if word % 7 == 0 or word >= words.numel() - 40 else patterns[:2]:
            bad = words.clone()
            bad[word] = pattern
            verdict = torch_form(bad, index)
            assert numba_form(bad, index) == verdict, f"word {word} = {pattern:#x}"
            verdicts.append(verdict)
    assert any(verdicts) and not all(verdicts)


def test_a_last_word_bit_past_the_part_is_rejected(monkeypatch):
    """The bit just past a part's last element, and the one before it (its own last code): the first fails, the
    second passes, in both forms."""
    words, index = _group("threebit")
    torch_form, numba_form = _forms(monkeypatch)
    assert index.last.numel() > 0
    for position, shift in zip(index.last.tolist(), index.shifts.tolist()):
        past, own = words.clone(), words.clone()
        past[position] |= 1 << int(shift)
        own[position] = (int(own[position]) & ~(7 << (int(shift) - 3))) | (6 << (int(shift) - 3))
        assert not torch_form(past, index) and not numba_form(past, index)
        assert torch_form(own, index) and numba_form(own, index)
