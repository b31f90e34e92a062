"""Every load option is declared once (edge0.options.LoadOptions): the CLI's flags, the keywords
edge0.load takes and the table in docs/engine-api.md all list the same options."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

import edge0
from edge0.cli.common import add_model_options, load_options
from edge0.errors import Edge0Error
from edge0.options import LoadOptions

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine-api.md"
NAMES = {f.name for f in fields(LoadOptions)}


def doc_table_options() -> set[str]:
    text = DOC.read_text()
    section = text.split("## Load options", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_model_options(p)
    return p


def test_cli_flags_load_keywords_and_docs_list_the_same_options():
    dests = {a.dest for a in parser()._actions} - {"help", "model"}
    assert dests == NAMES
    assert doc_table_options() == NAMES
    assert set(load_options(parser().parse_args([]))) == NAMES


def test_cli_defaults_are_the_dataclass_defaults():
    assert LoadOptions(**load_options(parser().parse_args([]))) == LoadOptions()


def test_flags_map_onto_options():
    args = parser().parse_args(
        [
            "--expert-cache",
            "2GB",
            "--no-prerouter",
            "--lora",
            "a.safetensors",
            "--layer-executor",
            "3:decode=hot",
            "--top-k",
            "2",
            "--cold-reads",
        ]
    )
    o = load_options(args)
    assert (o["expert_cache"], o["prerouter"], o["lora"], o["layer_executors"], o["top_k"], o["cold_reads"]) == (
        "2GB",
        False,
        "a.safetensors",
        {3: {"decode": "hot"}},
        2,
        True,
    )


def test_unknown_keyword_and_bad_values_are_refused():
    with pytest.raises(TypeError, match="bogus"):
        edge0.load(None, bogus=1)
    for kw, flag in [
        ({"decode_executor": "fast"}, "--decode-executor"),
        ({"dtype": "int8"}, "--dtype"),
        ({"layer_executors": {1: {"decode": "fast"}}}, "--decode-executor \\(layer 1\\)"),
        ({"top_k": 0}, "--top-k 0"),
    ]:
        with pytest.raises(Edge0Error, match=flag):
            LoadOptions(**kw).validate()
