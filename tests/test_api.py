"""The public API: what ``import gradcomp`` offers, and what stays in its modules."""
import subprocess
import sys

import gradcomp

PUBLIC = {
    "Compressor", "TopK", "TwoBit", "ThreeBit", "Identity", "FP16", "BF16", "from_spec", "register", "Auto",
    "DenseWarmup", "SparsityRamp", "recommended", "FrozenVarianceAdam", "RecipeNotice", "PayloadError",
    "SettingsMismatchError",
}  # fmt: skip


def test_all_is_the_public_api_and_every_name_resolves():
    assert set(gradcomp.__all__) == PUBLIC and len(gradcomp.__all__) == len(PUBLIC)
    for name in gradcomp.__all__:
        assert getattr(gradcomp, name) is not None


def test_the_public_names_are_the_objects_of_their_modules():
    from gradcomp.hooks import ddp
    from gradcomp.optim import FrozenVarianceAdam
    from gradcomp.setup import RecipeNotice

    assert gradcomp.register is ddp.register
    assert gradcomp.schedule.recommended is gradcomp.recommended  # gradcomp.schedule after import gradcomp
    assert gradcomp.FrozenVarianceAdam is FrozenVarianceAdam and gradcomp.RecipeNotice is RecipeNotice
    assert issubclass(gradcomp.TopK, gradcomp.Compressor)


def test_internals_stay_in_their_modules():
    for name in ("Engine", "Payload", "PayloadLayout", "ErrorFeedback"):
        assert not hasattr(gradcomp, name), name
    from gradcomp.engine import Engine  # noqa: F401
    from gradcomp.error_feedback import ErrorFeedback  # noqa: F401
    from gradcomp.payload import Payload, PayloadLayout  # noqa: F401


def test_import_needs_no_optional_dependency():
    code = (
        "import sys, gradcomp; from gradcomp import *; "
        "loaded = [m for m in ('numba', 'cupy', 'horovod') if m in sys.modules]; "
        "assert not loaded, loaded; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
