"""Fixtures shared by the model tests."""
from __future__ import annotations

import pytest
from model_utils import load_tiny


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """``model_utils.TINY`` with its projections quantized on the native CPU kernel (``rooflm.kernels.cpu_native``,
    the default where it builds: ``"w4a16"``, ``"w8a16"``), float (``"none"``) and, as ``"w4a16-torch"``, on torch's
    int4 kernel (``ROOFLM_CPU_NATIVE=off`` when the weights are prepared): {name: (model, config)}."""
    models = {q: load_tiny(tmp_path_factory, q) for q in ("w4a16", "w8a16", "none")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROOFLM_CPU_NATIVE", "off")
        models["w4a16-torch"] = load_tiny(tmp_path_factory, "w4a16")
    assert models["w4a16-torch"][0].model.layers[0].mlp.down_proj._cpu_weight.kind == "int4"
    return models
