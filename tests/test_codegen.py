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


def test_templates_spell_intrinsics_only_through_the_target_tables():
    """Every C intrinsic comes from a spelling table (pcldnn_gen.spelling), never from a template,
    and every table entry is used by some template: a new target is a new table. The tables
    themselves are read back through Spelling, so an op named with a pattern that does not parse
    as one call (a typo in a brace) is caught too."""
    from importlib import resources

    from pcldnn_gen import spelling
    texts = {p.name: p.read_text() for p in resources.files("pcldnn_gen.templates").iterdir() if p.name.endswith(".j2")}
    raw = {name: sorted(set(re.findall(r"\b_(?:mm\d*|tile)_\w+\s*\(", t))) for name, t in texts.items()}
    assert {name: calls for name, calls in raw.items() if calls} == {}
    every = "".join(texts.values())
    for var, table in (("bf", spelling.AVX512_BF16), ("tile", spelling.AMX_TILES)):
        unused = [op for op in table.ops if not re.search(rf"(?<![\w.]){var}\.{op}\b", every)]
        assert unused == [], f"{table.target}: ops no template uses"
        for op, pattern in table.ops.items():
            operands = [f"x{i}" for i in range(pattern.count("{") if "{*}" not in pattern else 3)]
            spelled = getattr(table, op)(*operands)
            assert "{" not in spelled and all(o in spelled for o in operands), (op, spelled)


def test_an_operation_a_target_lacks_fails_the_render():
    """A template reaching an op the target's table does not spell is an error naming both, and a
    target without a bf16 table (AVX2) cannot render a bf16 operation at all."""
    import jinja2

    from pcldnn_gen.spelling import AVX512_BF16, target_spellings
    with pytest.raises(AttributeError, match="AVX-512 with AVX512_BF16 has no spelling of 'load_twice'"):
        AVX512_BF16.load_twice("p")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    template = env.from_string("{{ bf.load('p') }}")
    assert template.render(**target_spellings("avx512", False)) == "_mm512_loadu_ps(p)"
    with pytest.raises(jinja2.UndefinedError):
        template.render(**target_spellings("avx2", False))
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ tile.zero(0) }}").render(**target_spellings("avx512", False))
