"""Generated C stays inert whatever the strings in the descriptions: user text reaches comments
only through `c_comment`, and names reach identifiers only after a full-match check.

Each template is rendered twice, with benign and with hostile strings in every string field
that reaches it (the arch name, the plan's explanation, its kind and units); with the comments
removed, the two C texts must be identical: nothing a string holds can become code."""
from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcldnn_gen.arch import PRESETS
from pcldnn_gen.build import plan_net
from pcldnn_gen.codegen import c_comment, render_kernel, render_layout
from pcldnn_gen.errors import PlanError
from pcldnn_gen.netspec import parse_netspec

# Every kernel family: conv with few input channels (its own bwd_data template), conv with
# padding and stride (edge tiles), both pools, relu, dropout, fc, loss.
NET = parse_netspec({"name": "allkinds", "input": {"channels": 3, "height": 9, "width": 9}, "layers": [
    {"name": "c1", "type": "conv", "out_channels": 16, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "c2", "type": "conv", "out_channels": 24, "kernel": 3, "stride": 2, "pad": 1},
    {"name": "mp", "type": "maxpool", "kernel": 2, "stride": 1},
    {"name": "r", "type": "relu"},
    {"name": "ap", "type": "avgpool", "kernel": 2},
    {"name": "d", "type": "dropout", "rate": 0.25},
    {"name": "f1", "type": "fc", "out_features": 10, "activation": "relu"},
    {"name": "f2", "type": "fc", "out_features": 4},
    {"name": "loss", "type": "softmax_cross_entropy"}]})

HOSTILE = [
    "x */ __attribute__((constructor)) static void f(void){ system(\"id\"); } /*",
    "*/\n#include </etc/passwd>\n/*",
    "a\\\nb */ int y; /*",
    "??/\n*/ int z; /*",
    "/* nested */ */ */",
    "\u202e*/ evil /*",
    "line\r*/ int q; /*",
    "*",
    "/",
]


def strip_comments(c: str) -> str:
    """C text with /* */ and // comments removed (string and char literals respected)."""
    out, i, n = [], 0, len(c)
    while i < n:
        if c.startswith("/*", i):
            end = c.find("*/", i + 2)
            assert end >= 0, "unterminated comment"
            i = end + 2
            out.append(" ")
        elif c.startswith("//", i):
            while i < n and c[i] != "\n":
                i += 1
        elif c[i] in "\"'":
            quote, j = c[i], i + 1
            while c[j] != quote:
                j += 2 if c[j] == "\\" else 1
            out.append(c[i:j + 1])
            i = j + 1
        else:
            out.append(c[i])
            i += 1
    return re.sub(r"\s+", " ", "".join(out))


def renders(arch, text: str | None):
    """(name, C) of every kernel and layout file of NET, with `text` in every string field."""
    if text is not None:
        arch = dataclasses.replace(arch, name=text)
    plans = plan_net(NET, arch)
    for layer in NET.layers:
        for (name, _), plan in plans.items():
            if name != layer.name:
                continue
            if text is not None:
                plan = dataclasses.replace(plan, reason=text + " " + plan.reason)
            yield f"{layer.name}/{plan.pass_name}", render_kernel(layer, plan, arch).text
        yield f"{layer.name}/layout", render_layout(layer, arch).text


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_hostile_strings_never_become_code(isa):
    benign = dict(renders(PRESETS[isa], None))
    assert len(benign) >= 20
    for text in HOSTILE:
        for name, c in renders(PRESETS[isa], text):
            assert strip_comments(c) == strip_comments(benign[name]), (name, text)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_c_comment_makes_any_text_inert(text):
    inert = c_comment(text)
    assert "*/" not in inert and "/*" not in inert and "??" not in inert
    assert all(" " <= ch <= "~" and ch != "\\" for ch in inert)
    # wrapped in a comment, the text adds no code
    assert strip_comments(f"int a; /* {inert} */ int b;") == "int a; int b;"


@pytest.mark.parametrize("name", ["x */ int y; /*", "a b", "conv1\n", "", "1x", "a" * 65, "é"])
def test_names_that_are_not_identifiers_are_refused_by_codegen(name):
    """netspec refuses such names; the generator checks again where a name becomes a symbol."""
    layer = dataclasses.replace(NET.layers[0], name=name)
    plan = plan_net(NET, PRESETS["avx2"])[("c1", "fwd")]
    with pytest.raises(PlanError, match="cannot be used in a C identifier"):
        render_kernel(layer, plan, PRESETS["avx2"])
    with pytest.raises(PlanError, match="cannot be used in a C identifier"):
        render_layout(layer, PRESETS["avx2"])
