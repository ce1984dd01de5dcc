"""The tuning database and `pcldnn-gen tune`: measured tiles reach compile only as one of the
planner's own candidates, a broken database is one error line, the tuner's records agree with
its own measurements."""
from __future__ import annotations

import json

import pytest
from helpers import RUNNABLE_ISAS

from pcldnn_gen import cli
from pcldnn_gen.arch import get_arch
from pcldnn_gen.build import build
from pcldnn_gen.errors import PlanError
from pcldnn_gen.netspec import parse_netspec
from pcldnn_gen.planner import LAYER_PASSES, Measured, TileTiming, plan_layer
from pcldnn_gen.tuner import NOISE, tune
from pcldnn_gen.tuning import FORMAT, Entry, TuningDB, TuningError, kernel_key, plan_key

ISA = RUNNABLE_ISAS[-1]  # the widest this CPU runs: most candidates
NET_JSON = {"name": "tn", "input": {"channels": 16, "height": 12, "width": 12}, "layers": [
    {"name": "c1", "type": "conv", "out_channels": 32, "kernel": 3, "pad": 1, "activation": "relu"},
    {"name": "p1", "type": "maxpool", "kernel": 2, "stride": 2},
    {"name": "f1", "type": "fc", "out_features": 40},
    {"name": "loss", "type": "softmax_cross_entropy"}]}
NET = parse_netspec(NET_JSON)


@pytest.fixture
def db_path(tmp_path, monkeypatch):
    path = tmp_path / "db" / "tuning.json"
    monkeypatch.setenv("PCLDNN_TUNING_DB", str(path))
    return path


def _entry(layer, pass_name, arch, choice, model=None, plan=None) -> Entry:
    """An entry choosing `choice` over the model's tile for the fp32 kernel, or for the kernel
    `plan` makes (its key: precision and bf16 operands too)."""
    key = kernel_key(layer, pass_name, arch, plan_layer(layer, pass_name, arch).template) if plan is None else \
        plan_key(layer, plan, arch)
    plan = plan or plan_layer(layer, pass_name, arch)
    model = model or (plan.tile.width, plan.tile.vectors)
    tiles = [(choice, 1.0)] + ([(model, 1.5)] if model != choice else [])
    timings = tuple(TileTiming(width=w, vectors=v, predicted_efficiency=0.5, ms=ms) for (w, v), ms in tiles)
    measured = Measured(model=model, batch=4, threads=1, peak_gflops=100.0, flops=layer.flops(4), timings=timings)
    return Entry(key, arch.name, choice, measured)


@pytest.mark.parametrize("pass_name", ["fwd", "bwd_data", "bwd_weights"])
def test_every_candidate_can_be_chosen_and_nothing_else(pass_name):
    arch = get_arch("avx512")
    layer = NET.layer("c1")
    model = plan_layer(layer, pass_name, arch)
    for t in model.rejected:
        forced = plan_layer(layer, pass_name, arch, (t.width, t.vectors))
        assert (forced.tile.width, forced.tile.vectors) == (t.width, t.vectors)
        assert forced.predicted_efficiency > 0
    with pytest.raises(PlanError, match="no candidate register tile 64x64"):
        plan_layer(layer, pass_name, arch, (64, 64))
    with pytest.raises(PlanError, match="no register tile"):
        plan_layer(NET.layer("p1"), "fwd", arch, (1, 1))


def test_compile_uses_a_matching_entry_and_ignores_the_rest(tmp_path, db_path, capsys):
    arch = get_arch(ISA)
    conv, fc = NET.layer("c1"), NET.layer("f1")
    rejected = plan_layer(conv, "fwd", arch).rejected[0]
    chosen = (rejected.width, rejected.vectors)
    stale = _entry(fc, "fwd", arch, (64, 64))  # no longer a candidate: the model decides
    other_isa = _entry(conv, "bwd_data", get_arch("scalar" if ISA != "scalar" else "avx2"), (1, 1))
    TuningDB(db_path).merge_into([_entry(conv, "fwd", arch, chosen), stale, other_isa])
    assert len(json.loads(db_path.read_text())["entries"]) == 3

    result = build(NET, arch, tmp_path / "b", tuning=TuningDB.load())
    plans = result.plans
    assert (plans[("c1", "fwd")].tile.width, plans[("c1", "fwd")].tile.vectors) == chosen
    assert plans[("c1", "fwd")].measured is not None
    model = plan_layer(fc, "fwd", arch)
    assert plans[("f1", "fwd")].tile == model.tile and plans[("f1", "fwd")].measured is None
    assert plans[("c1", "bwd_data")] == plan_layer(conv, "bwd_data", arch)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    record = manifest["layers"][0]["kernels"]["fwd"]["plan"]
    conv_model = plan_layer(conv, "fwd", arch).tile
    assert [record["tile"]["width"], record["tile"]["vectors"]] == list(chosen)
    assert record["tuned"]["model_tile"] == [conv_model.width, conv_model.vectors]
    assert "tuned" not in manifest["layers"][0]["kernels"]["bwd_data"]["plan"]
    assert "tuned   : tile from the tuning database" in (tmp_path / "b" / "src" / "c1_fwd.c").read_text()

    # The CLI marks tiles from the database; --no-tuning gives the model's plan.
    net_file = tmp_path / "n.json"
    net_file.write_text(json.dumps(NET_JSON))
    assert cli.main(["compile", str(net_file), "--arch", ISA, "-o", str(tmp_path / "t")]) == 0
    assert cli.main(["compile", str(net_file), "--arch", ISA, "-o", str(tmp_path / "m"), "--no-tuning"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.count(" tuned") for line in out if line.strip().startswith("c1 ")] == [1, 0]
    assert "tuned" not in (tmp_path / "m" / "src" / "c1_fwd.c").read_text()


def test_inspect_explain_shows_prediction_beside_measurement(tmp_path, db_path, capsys):
    arch = get_arch(ISA)
    net_file = tmp_path / "n.json"
    net_file.write_text(json.dumps(NET_JSON))
    conv = NET.layer("c1")
    t = plan_layer(conv, "bwd_weights", arch).rejected[0]
    TuningDB(db_path).merge_into([_entry(conv, "bwd_weights", arch, (t.width, t.vectors))])
    assert cli.main(["inspect", str(net_file), "--layer", "c1", "--pass", "bwd_weights", "--arch", ISA,
                     "--explain"]) == 0
    out = capsys.readouterr().out
    assert f"chosen   : {t.width}x{t.vectors} " in out
    lines = [line for line in out.splitlines() if "model's first choice" in line or line.rstrip().endswith("used")]
    assert len(lines) == 2, out
    assert cli.main(["inspect", str(net_file), "--layer", "c1", "--pass", "bwd_weights", "--arch", ISA,
                     "--explain", "--no-tuning"]) == 0
    assert "measured : none" in capsys.readouterr().out


def _valid_db(arch) -> dict:
    conv = NET.layer("c1")
    t = plan_layer(conv, "fwd", arch).rejected[0]
    return {"format": FORMAT, "entries": [_entry(conv, "fwd", arch, (t.width, t.vectors)).to_json()]}


BROKEN = [
    (lambda d: d.update(format="pcldnn-tuning/0"), "format: must be one of"),
    (lambda d: d["entries"][0].update(choice=[0, 3]), r"entries\[0\]\.choice\[0\]: must be a positive int"),
    (lambda d: d["entries"][0].update(choice=[7, 7]), r"entries\[0\]\.choice: \[7, 7\] is not one of the measured"),
    (lambda d: d["entries"][0]["candidates"][0].update(ms=-1), r"candidates\[0\]\.ms: must be a number"),
    (lambda d: d["entries"][0]["key"].update(isa="avx1024"), r"key\.isa: must be one of"),
    (lambda d: d["entries"][0]["key"].update(cpu="x\ny"), r"key\.cpu: must be one line"),
    (lambda d: d["entries"][0].update(extra=1), r"entries\[0\]\.extra: unknown field"),
    (lambda d: d["entries"][0]["key"]["in_shape"].append(3), r"key\.in_shape: must be a list of 3 to 3"),
    (lambda d: d["entries"][0].update(candidates=[]), r"candidates: must be a list of 1 to 16"),
    (lambda d: d["entries"][0]["key"].update(precision="fp16"), r"key\.precision: must be one of"),
    (lambda d: d["entries"][0]["key"].update(activations=[0, 1]), r"key\.activations\[0\]: must be true or false"),
    (lambda d: d["entries"][0]["key"].pop("gradients"), r"key\.gradients: missing required field"),
    # format /1 (fp32 only): no operand fields, no bf16 kernel
    (lambda d: d.update(format="pcldnn-tuning/1"), r"key\.activations: unknown field"),
    (lambda d: (d.update(format="pcldnn-tuning/1"), [d["entries"][0]["key"].pop(k) for k in ("activations", "gradients")],
                d["entries"][0]["key"].update(precision="bf16")), r"key\.precision: must be one of fp32, got \"bf16\""),
]


@pytest.mark.parametrize("breakage,message", BROKEN)
def test_broken_database_is_one_error_line(tmp_path, db_path, capsys, breakage, message):
    data = _valid_db(get_arch(ISA))
    breakage(data)
    db_path.parent.mkdir()
    db_path.write_text(json.dumps(data))
    with pytest.raises(TuningError, match=message):
        TuningDB.load()
    net_file = tmp_path / "n.json"
    net_file.write_text(json.dumps({"name": "x", "input": {"channels": 3, "height": 4, "width": 4},
                                    "layers": [{"name": "c", "type": "conv", "out_channels": 8, "kernel": 3}]}))
    assert cli.main(["compile", str(net_file), "--arch", ISA, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {db_path}: ") and not (tmp_path / "out").exists()
    # --no-tuning does not read it
    assert cli.main(["compile", str(net_file), "--arch", ISA, "-o", str(tmp_path / "out"), "--no-tuning"]) == 0


@pytest.mark.parametrize("text", ["", "{", '{"format": "pcldnn-tuning/1", "entries": [], "entries": []}', "[]",
                                  '{"format": "pcldnn-tuning/1", "entries": [NaN]}'])
def test_unparsable_database_is_one_error_line(db_path, text):
    db_path.parent.mkdir()
    db_path.write_text(text)
    with pytest.raises(TuningError, match=str(db_path)):
        TuningDB.load()


def test_tune_records_what_it_measured(db_path, capsys):
    arch = get_arch(ISA)
    report = tune([NET], arch, batch=4, threads=1, candidates=3, rounds=1, repeats=1, db=TuningDB.load())
    tunable = [(l.name, p) for l in NET.layers if l.weighted for p in LAYER_PASSES[l.type]
               if len(plan_layer(l, p, arch).rejected) >= 1]
    assert sorted((r.layer, r.pass_name) for r in report.rows) == sorted(tunable)
    db = TuningDB.load()
    assert len(db.entries) == len(tunable)
    for row in report.rows:
        layer = NET.layer(row.layer)
        entry = db.lookup(layer, row.pass_name, arch, plan_layer(layer, row.pass_name, arch))
        times = {(t.width, t.vectors): t.ms for t in entry.measured.timings}
        assert len(times) == row.candidates == min(3, 1 + len(plan_layer(layer, row.pass_name, arch).rejected))
        # best first (by per-round ratios); the file keeps ms to 6 decimals
        first = entry.measured.timings[0]
        assert (first.width, first.vectors) == row.best
        assert times[row.best] == pytest.approx(row.best_ms, rel=1e-4, abs=1e-6)
        assert times[row.model] == pytest.approx(row.model_ms, rel=1e-4, abs=1e-6)
        assert row.gain >= 1.0 and (row.gain == 1.0) == (row.best == row.model)
        # the model keeps its tile unless beaten by more than the noise margin
        assert entry.choice == (row.best if row.gain > 1 + NOISE else row.model)
        assert db.plan(layer, row.pass_name, arch).tile.width == entry.choice[0]
    # a second run measures nothing already known, unless forced
    again = tune([NET], arch, batch=4, threads=1, candidates=3, rounds=1, repeats=1, db=db)
    assert again.rows == () and again.known == len(tunable)
    short = tune([NET], arch, batch=4, threads=1, candidates=2, rounds=1, repeats=1, db=db, force=True, budget=1e-9)
    assert short.rows == () and short.unmeasured == len(tunable)


def test_tune_command_line(tmp_path, db_path, capsys):
    net_file = tmp_path / "n.json"
    net_file.write_text(json.dumps(NET_JSON))
    out_json = tmp_path / "tune.json"
    assert cli.main(["tune", str(net_file), "--arch", ISA, "--threads", "1", "--batch", "2", "--rounds", "1",
                     "--candidates", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "model's first choice measured fastest" in out and str(db_path) in out
    report = json.loads(out_json.read_text())
    assert report["rows"] and all(r["candidates"] == 2 for r in report["rows"])
    assert len(TuningDB.load().entries) == len(report["rows"])
    for bad in (["tune", str(net_file), "--zoo", str(net_file)], ["tune"], ["tune", str(net_file), "--budget", "0"],
                ["tune", str(net_file), "--budget", "nan"], ["tune", str(net_file), "--candidates", "1"],
                ["tune", str(net_file), "--precision", "fp16"], ["tune", str(net_file), "--arch", "avx2",
                                                                 "--precision", "bf16"]):
        assert _exit_code(bad) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_tune_bf16_needs_a_cpu_that_runs_the_build(tmp_path, db_path, capsys, monkeypatch):
    """Tuning a bf16 build times it, so on a CPU without AVX512_BF16 it stops before building,
    with one line (the bf16 kernels would die by SIGILL)."""
    from pcldnn_runtime import cpu
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(cpu.ISA_FLAGS["avx512"]))
    net_file = tmp_path / "n.json"
    net_file.write_text(json.dumps(NET_JSON))
    assert cli.main(["tune", str(net_file), "--arch", "avx512", "--precision", "bf16"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "lacks avx512_bf16; tune where the bf16 build will run" in captured.err
    assert "tuning" not in captured.out and not db_path.exists()


def _exit_code(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's usage errors
        return int(e.code or 0)


def test_bench_marks_kernels_whose_tile_was_tuned(db_path):
    from pcldnn_gen import bench
    arch = get_arch(ISA)
    conv = NET.layer("c1")
    t = plan_layer(conv, "fwd", arch).rejected[0]
    TuningDB(db_path).merge_into([_entry(conv, "fwd", arch, (t.width, t.vectors))])
    _, results = bench.bench_net(NET, arch, batch=2, threads=1, repeats=1, peak=100.0, tuning=TuningDB.load())
    assert [(r.layer, r.pass_name) for r in results if r.tuned] == [("c1", "fwd")]
    assert "1 of 6 kernels use a tile from the tuning database" in bench.format_table("t", arch, 2, 1, 100.0, results)
    _, untuned = bench.bench_net(NET, arch, batch=2, threads=1, repeats=1, peak=100.0)
    assert not any(r.tuned for r in untuned)


def test_fp32_only_format_is_read_and_written_back_as_the_current_one(db_path):
    """A database of format /1 (before bf16 tuning: keys without the operand fields) keeps its
    measurements: read as fp32 kernels on fp32 operands, merged into the current format."""
    arch = get_arch(ISA)
    conv = NET.layer("c1")
    old = _valid_db(arch)
    old["format"] = "pcldnn-tuning/1"
    for k in ("activations", "gradients"):
        del old["entries"][0]["key"][k]
    db_path.parent.mkdir()
    db_path.write_text(json.dumps(old))
    db = TuningDB.load()
    model = plan_layer(conv, "fwd", arch)
    assert db.plan(conv, "fwd", arch).measured is not None
    assert db.lookup(conv, "fwd", arch, model).choice == tuple(old["entries"][0]["choice"])
    t = plan_layer(NET.layer("f1"), "fwd", arch).tile
    db.merge_into([_entry(NET.layer("f1"), "fwd", arch, (t.width, t.vectors))])
    written = json.loads(db_path.read_text())
    assert written["format"] == FORMAT and len(TuningDB.load().entries) == 2
    assert all(e["key"]["activations"] == e["key"]["gradients"] == [False, False] for e in written["entries"])


def test_template_version_follows_imports(monkeypatch):
    """An edit to a macro file a template imports (conv_fwd.c.j2 imports _bf16.c.j2) makes its
    old measurements miss; one to a file it does not import leaves them."""
    import jinja2

    from pcldnn_gen import tuning
    texts = {"k.c.j2": '{%- import "_common.c.j2" as c -%}{%- import "_bf16.c.j2" as b -%}k', "_common.c.j2": "c",
             "_bf16.c.j2": "{% include '_inner.c.j2' %}", "_inner.c.j2": "1", "other.c.j2": "o"}

    def version() -> str:
        env = jinja2.Environment(loader=jinja2.DictLoader(dict(texts)))
        monkeypatch.setattr(tuning, "template_env", lambda: env)
        tuning.template_version.cache_clear()
        return tuning.template_version("k.c.j2")

    first = version()
    texts["other.c.j2"] = "changed"
    assert version() == first
    texts["_inner.c.j2"] = "2"
    assert version() != first
    tuning.template_version.cache_clear()


# NET with a second conv: c2 reads and writes bf16 activations in a bf16 build
BF16_NET_JSON = {**NET_JSON, "layers": [NET_JSON["layers"][0], {"name": "c2", "type": "conv", "out_channels": 32,
                                                                "kernel": 3, "pad": 1, "activation": "relu"},
                                        *NET_JSON["layers"][1:]]}


def _bf16_net():
    return parse_netspec(BF16_NET_JSON)


def test_bf16_kernels_have_entries_of_their_own(tmp_path, db_path):
    """A measured tile of a bf16 kernel reaches the bf16 build only, and only where the kernel
    reads and writes the same bf16 operands; the fp32 build of the same layer keeps the model's."""
    from pcldnn_gen.build import net_activations, net_gradients, plan_kernel, plan_net
    arch = get_arch("avx512")
    net = _bf16_net()
    acts, grads = net_activations(net, arch, "bf16"), net_gradients(net, arch, "bf16")
    c2 = net.layer("c2")
    entries = []
    for p in LAYER_PASSES["conv"]:
        model = plan_kernel(c2, p, arch, None, None, "bf16", acts["c2"], grads["c2"])
        assert model.kind.endswith("_bf16") and len(model.candidate_tiles) >= 2
        t = model.rejected[0]
        entries.append(entry := _entry(c2, p, arch, (t.width, t.vectors), plan=model))
        assert entry.key["precision"] == "bf16" and (entry.key["activations"], entry.key["gradients"]) == (
            list(model.activations), list(model.gradients))
    TuningDB(db_path).merge_into(entries)
    db = TuningDB.load()
    bf16_plans, fp32_plans = plan_net(net, arch, db, precision="bf16"), plan_net(net, arch, db)
    for entry, p in zip(entries, LAYER_PASSES["conv"]):
        plan = bf16_plans[("c2", p)]
        assert (plan.tile.width, plan.tile.vectors) == entry.choice and plan.measured is not None, p
        assert fp32_plans[("c2", p)].measured is None
        # the same shape on fp32 operands (c1 reads the fp32 image; same shape as c2 only if
        # channels match, so check the key instead): the operand fields make another key
        other = plan_kernel(c2, p, arch, None, None, "bf16", (False, False), (False, False))
        assert (other.activations, other.gradients) != (plan.activations, plan.gradients), p
        assert db.lookup(c2, p, arch, other) is None, p
    assert all(plan.measured is None for (layer, _), plan in bf16_plans.items() if layer != "c2")


def test_inspect_explains_a_tuned_bf16_kernel(tmp_path, db_path, capsys):
    """`inspect --precision bf16 --explain` shows the bf16 kernel's measurement (its % against
    the fp32 FMA peak, said so) and, without an entry, the tune command with its precision."""
    from pcldnn_gen.build import net_activations, net_gradients, plan_kernel
    arch = get_arch("avx512")
    net = _bf16_net()
    net_file = tmp_path / "n.json"
    net_file.write_text(json.dumps(BF16_NET_JSON))
    argv = ["inspect", str(net_file), "--layer", "c2", "--pass", "bwd_weights", "--arch", "avx512", "--precision",
            "bf16", "--explain"]
    assert cli.main(argv) == 0
    assert "`pcldnn-gen tune " in (out := capsys.readouterr().out) and "--precision bf16` times" in out
    model = plan_kernel(net.layer("c2"), "bwd_weights", arch, None, None, "bf16",
                        net_activations(net, arch, "bf16")["c2"], net_gradients(net, arch, "bf16")["c2"])
    t = model.rejected[0]
    TuningDB(db_path).merge_into([_entry(net.layer("c2"), "bwd_weights", arch, (t.width, t.vectors), plan=model)])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"chosen   : {t.width}x{t.vectors} " in out and "fp32 FMA peak 100.0 GFLOP/s" in out
    assert "% of fp32 peak" in out


@pytest.mark.bf16_kernels
def test_tune_bf16_times_the_bf16_builds_kernels(db_path, capsys):
    """`tune --precision bf16` times the kernels a bf16 build holds (vdpbf16ps conv; the fc's
    vdpbf16ps tile kernels have one shape, nothing to choose) and records them as bf16 entries,
    which the bf16 build then uses and the fp32 tuning of the same net does not count as known."""
    from pcldnn_gen.build import plan_net
    arch = get_arch("avx512")
    net = _bf16_net()
    report = tune([net], arch, batch=2, threads=1, candidates=2, rounds=1, repeats=1, db=TuningDB.load(),
                  precision="bf16")
    assert sorted((r.layer, r.pass_name) for r in report.rows) == [(c, p) for c in ("c1", "c2")
                                                                  for p in sorted(LAYER_PASSES["conv"])]
    assert report.single == len(LAYER_PASSES["fc"])
    db = TuningDB.load()
    assert {e.key["precision"] for e in db.entries.values()} == {"bf16"}
    plans = plan_net(net, arch, db, precision="bf16")
    for row in report.rows:
        plan = plans[(row.layer, row.pass_name)]
        assert plan.kind.endswith("_bf16") and plan.measured is not None
        assert (plan.tile.width, plan.tile.vectors) == row.choice
    fp32 = tune([net], arch, batch=2, threads=1, candidates=2, rounds=1, repeats=1, db=db, budget=1e-9)
    assert fp32.known == 0 and fp32.unmeasured > 0
