"""The JSON schema of a run recipe (trace_common.config.RunConfig), as the Helm chart's
values.schema.json holds it under `trainer.run`: every key of the tree with its type, unknown
and derived keys refused, so `helm install` catches a misspelt run key before the trainer does.

    .venv/bin/python deploy/tools/chart_run_schema.py    # rewrite charts/trace/values.schema.json

tests/unit/deploy/test_chart.py checks that the chart's copy equals `run_schema()`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing
from typing import Any, Literal

from trace_common.config import DERIVED, RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "charts/trace/values.schema.json"
FLOAT_RE = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"
DESCRIPTION = (
    "the run, rendered as the trainer's recipe (TRACE_RECIPE): keys of "
    "trace_common.config.RunConfig, tables as maps; keys left out keep their defaults"
)


def type_schema(tp: Any) -> dict[str, Any]:
    """JSON schema of one declared field type of the tree."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # X | None: None is "left out"
        (arg,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return type_schema(arg)
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is tuple:
        return {"type": "array", "items": type_schema(typing.get_args(tp)[0])}
    if origin is dict:
        return {"type": "object"}
    if dataclasses.is_dataclass(tp):
        return table_schema(tp, "")
    if tp is float:  # `helm --set x=1e-4` passes a float as a string; the trainer parses it
        return {"anyOf": [{"type": "number"}, {"type": "string", "pattern": FLOAT_RE}]}
    simple = {bool: "boolean", int: "integer", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    if tp is pathlib.Path:
        return {"type": "string", "minLength": 1}
    raise TypeError(f"no JSON schema for {tp!r}")


def table_schema(cls: type, prefix: str) -> dict[str, Any]:
    """A section of the tree: its keys (derived ones left out), nothing else."""
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if not f.init or path in DERIVED:
            continue
        tp = hints[f.name]
        props[f.name] = (
            table_schema(tp, f"{path}.") if dataclasses.is_dataclass(tp) else type_schema(tp)
        )
    return {"type": "object", "properties": props, "additionalProperties": False}


def run_schema() -> dict[str, Any]:
    return {"description": DESCRIPTION, **table_schema(RunConfig, "")}


def main() -> None:
    schema = json.loads(SCHEMA.read_text())
    schema["properties"]["trainer"]["properties"]["run"] = run_schema()
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"wrote trainer.run of {SCHEMA.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
