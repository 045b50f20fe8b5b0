"""Start an engine on one device per TP rank: in this process at TP 1, with follower ranks above."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from services.engine.engine_config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.loading.source import resolve_model
from services.engine.tp.group import TPGroup


def start_engine(config: EngineConfig, devices: Sequence[str], log_level: str = "WARNING") -> LLMEngine:
    """``devices[r]`` is rank r's device. The model is checked against the TP size before any
    follower starts, so "3 KV heads over 2 ranks" is one clear error, not N failing processes."""
    if len(devices) != config.parallel.tp_size:
        raise ValueError(f"{len(devices)} devices for {config.parallel.tp_size} TP ranks")
    config = replace(config, device=devices[0])
    source = resolve_model(config.model)
    config.parallel.check_model(source.config)
    if config.parallel.tp_size == 1:
        return LLMEngine(config, source)
    group = TPGroup(config, devices, log_level)
    try:
        return LLMEngine(config, source, tp_group=group)
    except BaseException:
        group.close()
        raise
