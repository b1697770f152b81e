"""The delay error feedback adds at a sparsifier's density and the shorter memory that gives it up
(gradcomp.optim.delay): the law of Adam's first moment under top-k (its use in test_optim_units.py)."""
import pytest

from gradcomp.optim.delay import DELAY_DENSITY, DELAY_MOMENTUM, DELAY_STEPS, compressed_momentum, delay_at, memory_share


def test_a_shorter_memory_gives_up_the_same_share_of_itself_and_a_longer_one_the_screened_steps():
    """memory_share(beta): m / m0 below DELAY_MOMENTUM (m = beta / (1 - beta)), 1 at and above it, so the study's
    loops (momentum 0.9) give up DELAY_STEPS bit for bit."""
    assert DELAY_MOMENTUM == 0.9 and memory_share(0.9) == 1.0 and memory_share(0.99) == 1.0
    assert memory_share(0.8) == pytest.approx(4 / 9) and memory_share(0.5) == pytest.approx(1 / 9)
    assert memory_share(0.0) == 0.0
    for beta in (0.3, 0.5, 0.8, 0.9):  # the same share of the memory is left: beta' / (1 - beta') over m
        fast, m = compressed_momentum(beta, DELAY_STEPS * memory_share(beta)), beta / (1 - beta)
        assert fast / (1 - fast) / m == pytest.approx(4 / 9)


def test_the_shortened_momentum_gives_up_the_delay_in_steps_and_never_goes_below_zero():
    assert compressed_momentum(0.9) == pytest.approx(0.8)  # 9 steps' mean delay less 5: 4 = 0.8 / 0.2
    assert compressed_momentum(0.95) == pytest.approx(14 / 15)
    assert compressed_momentum(0.5) == 0.0 and compressed_momentum(0.0) == 0.0
    assert compressed_momentum(0.9, delay_steps=0) == pytest.approx(0.9)
    betas = [0.5, 0.8, 0.9, 0.95, 0.99]
    shortened = [compressed_momentum(b) for b in betas]
    assert shortened == sorted(shortened) and all(s < b for s, b in zip(shortened, betas))
    assert DELAY_STEPS == 5.0


def test_a_denser_payload_gives_up_less_delay_and_the_delay_is_capped():
    """log(1/rho) / log(1/DELAY_DENSITY) of DELAY_STEPS: the ramp's first density 1/8 gives up 2.26 steps
    (momentum 0.9 becomes 0.87), 1 % the whole 5 (0.8); sparser payloads keep 5; dense gives up nothing."""
    assert DELAY_DENSITY == 0.01
    assert delay_at(0.01) == pytest.approx(DELAY_STEPS) and delay_at(0.001) == DELAY_STEPS
    assert delay_at(1 / 8) == pytest.approx(5 * 3 / (2 * 2.302585 / 0.693147), rel=1e-4)
    assert compressed_momentum(0.9, delay_at(1 / 8)) == pytest.approx(0.871, abs=1e-3)
    assert delay_at(1.0) == 0.0 and delay_at(0.0) == 0.0
    delays = [delay_at(d) for d in (1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 0.01)]
    assert delays == sorted(delays)
