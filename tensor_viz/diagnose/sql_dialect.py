"""The few SQL expressions DuckDB and Spark SQL spell differently, in one place.

Why here: diagnosis' queries (tensor_viz.diagnose.rules, diagnose_format, rank_tables) run
unchanged on both engines (tensor_viz.diagnose.spark's connection answers a DuckDB-style
``execute``); where the two dialects differ the query asks this module for the spelling of the
connection it was given. Everything else is the same SQL text.
"""
from __future__ import annotations

from typing import Any

#: expression -> its spelling per engine ({} fields are filled by str.format)
DIALECTS: dict[str, dict[str, str]] = {
    "duckdb": {"last_dim": "shape[-1]", "explode": "unnest", "array": "list_value",
               "hash": "hash"},
    "spark": {"last_dim": "element_at(shape, -1)", "explode": "explode", "array": "array",
              "hash": "xxhash64"},
}


def engine(con: Any) -> str:
    """The engine a connection speaks (a DuckDB connection has no ``dialect``)."""
    return getattr(con, "dialect", "duckdb")


def dialect(con: Any) -> dict[str, str]:
    return DIALECTS[engine(con)]


def named_struct(con: Any, fields: dict[str, str]) -> str:
    """A struct with named fields (name -> SQL expression), as the engine builds one."""
    if engine(con) == "spark":
        return "named_struct(" + ", ".join(f"'{k}', {v}" for k, v in fields.items()) + ")"
    return "struct_pack(" + ", ".join(f"{k} := {v}" for k, v in fields.items()) + ")"
