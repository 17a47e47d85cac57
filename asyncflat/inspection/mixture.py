"""What a mixture costs, before running it: per-source steps, passes and buffer memory.

``asyncflat inspect CONFIG --mixture --len L --batch B`` prints :func:`mixture_figures` of a
``MixtureParams`` read from a JSON or YAML file (the dict form of the dataclass). Only metadata
is read from each source.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from asyncflat.config import TokenBatchParams, redact_url
from asyncflat.errors import ConfigError
from asyncflat.inspection import describe_split, loader_figures
from asyncflat.loader.mixture.config import MixtureParams
from asyncflat.plan.coverage import format_bytes
from asyncflat.plan.mixture import Assignment, starved_warning

__all__ = ["figures_text", "inspect_mixture", "load_mixture_config", "mixture_figures"]


def load_mixture_config(path: str | os.PathLike[str]) -> MixtureParams:
    """A :class:`MixtureParams` from a JSON file, or a YAML one (``.yaml``/``.yml``, needs
    PyYAML); the file holds the dataclass's dict form (``sources`` of ``params`` and ``weight``,
    optional ``seed``, ``block_rows``, ``stages``, ``steps``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the mixture config: {exc}") from None
    if Path(path).suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError("reading a YAML mixture config needs PyYAML") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON (YAML needs .yaml or .yml): {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a mixture config is a mapping, got {type(data).__name__}")
    try:
        return MixtureParams(**data)
    except TypeError as exc:  # unknown or missing fields
        raise ConfigError(f"{path}: {exc}") from None


def mixture_figures(
    params: MixtureParams, batch_params: TokenBatchParams, split: str = "train", *, hosts: int = 1
) -> dict[str, Any]:
    """Per source: weight, steps and shuffle-buffer bytes per host of one pass, and the passes the
    mixture's ``step_count`` needs; plus the mixture's steps and its buffer bytes per host."""
    if batch_params.batch % params.streams:
        raise ConfigError(
            f"batch {batch_params.batch} is not a multiple of the sources' streams {params.streams}"
        )
    r = batch_params.batch // params.streams
    sources: list[dict[str, Any]] = []
    for source in params.sources:
        spec = source.params
        summary = describe_split(
            str(spec.filespec), split, scan_lengths=False, storage_options=spec.storage_options
        )
        figures = loader_figures(
            summary, spec, batch_params, hosts=hosts, storage_options=spec.storage_options
        )
        sources.append(
            {
                "filespec": redact_url(str(spec.filespec)),
                "weight": source.weight,
                "step_count": figures.step_count,
                "minipoch_count": figures.minipoch_count,
                "buffer_bytes_per_host": figures.buffer_bytes_per_host,
            }
        )
    assignment = Assignment(
        params.schedule(), r, params.block_rows, params.seed, streams=params.streams
    )
    capacity = [s["step_count"] * r for s in sources]
    steps = params.steps
    if steps is None:
        steps = assignment.first_exhausted_step(capacity, params.streams)
    for index, row in enumerate(sources):
        used = max(int(assignment.count_before(i, steps * r)[index]) for i in range(params.streams))
        row["passes"] = math.ceil(used / capacity[index]) if used else 0
    return {
        "split": split,
        "step_count": steps,
        "buffer_bytes_per_host": sum(s["buffer_bytes_per_host"] for s in sources),
        "sources": sources,
        "warning": starved_warning(assignment),
    }


def figures_text(figures: dict[str, Any], hosts: int = 1) -> str:
    """:func:`mixture_figures` as the lines ``asyncflat inspect --mixture`` prints."""
    lines = [
        f"mixture of {len(figures['sources'])} sources, {figures['split']}: "
        f"{figures['step_count']:,} steps; shuffle buffers "
        f"{format_bytes(figures['buffer_bytes_per_host'])} per host ({hosts} hosts)"
    ]
    for i, s in enumerate(figures["sources"]):
        lines.append(
            f"  {i} {s['filespec']}: weight {s['weight']:g}, {s['step_count']:,} steps a pass, "
            f"{s['passes']} pass(es) used; buffers {format_bytes(s['buffer_bytes_per_host'])} "
            "per host"
        )
    if figures.get("warning"):
        lines.append(f"warning: {figures['warning']}")
    return "\n".join(lines)


def inspect_mixture(
    path: str, length: int | None, batch: int | None, split: str | None, hosts: int
) -> dict[str, Any]:
    """What ``asyncflat inspect PATH --mixture`` computes (the CLI prints it)."""
    if length is None or batch is None:
        raise ConfigError("inspect --mixture needs --len and --batch")
    params = load_mixture_config(path)
    batch_params = TokenBatchParams(len=length, batch=batch)
    return mixture_figures(params, batch_params, split or "train", hosts=hosts)
