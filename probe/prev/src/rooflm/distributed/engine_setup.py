"""Bring an ``LLMEngine`` up inside a tensor-parallel group (kept out of the engine module: it only runs at N > 1)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine


def init_parallel_engine(engine: "LLMEngine", config: "EngineConfig", model: Any, model_config: Any,
                         tokenizer: Any) -> None:
    """Start the workers and join their group (``MultiprocExecutor``), then build ``engine`` as rank 0. A failure
    anywhere in the set-up stops the workers before it propagates."""
    from rooflm.distributed import parallel_state as ps
    from rooflm.distributed.executor import MultiprocExecutor

    if model is not None:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, pipeline_parallel_size="
                         f"{config.pipeline_parallel_size}: the engine loads the model itself, each rank its shard: "
                         "pass the model by name (config.model), not as a loaded module")
    check_model(config)  # before any process starts
    from rooflm.distributed.torchrun import TorchrunExecutor, torchrun_env

    env = torchrun_env()
    engine.parallel = (TorchrunExecutor(config, engine.device, *env) if env is not None
                       else MultiprocExecutor(config, engine.device))
    try:
        with ps.building_sharded_model():
            type(engine).__init__(engine, config, model=None, model_config=model_config, tokenizer=tokenizer)
    except BaseException:
        engine.parallel.shutdown()
        raise


def check_model(config: "EngineConfig") -> None:
    """ValueError naming ``tensor_parallel_size`` (``pipeline_parallel_size``, ``enable_expert_parallel``) when the
    model cannot be split that way (read from its config
    alone, without loading weights)."""
    from rooflm.config import load_model_config
    from rooflm.distributed.partition import check_pipeline_parallel, check_tensor_parallel
    from rooflm.loader import resolve_model

    path, fmt = resolve_model(config.model, config.load_format)
    if fmt == "gguf":
        from rooflm.loader.gguf import read_gguf_config

        cfg = read_gguf_config(path)
    else:
        cfg = load_model_config(path)
    check_tensor_parallel(cfg, config.tensor_parallel_size, config.enable_expert_parallel)
    check_pipeline_parallel(cfg, config.pipeline_parallel_size)
