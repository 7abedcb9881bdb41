"""Trace format: reader/writer, validation errors, JSONL converter, recorder."""
import json
import os
import threading

import numpy as np
import pytest

from moecached.tools.tracetools import convert_main
from moecached.engine.trace import Trace, TraceError, TraceRecorder, convert_jsonl, load_trace, save_trace

from fixtures import shared_traces

TRACES = shared_traces()


def small(**kw):
    ex = np.array([[[0, 1], [2, -1]], [[1, 3], [2, 0]], [[3, 0], [1, 2]]], np.int16)
    d = dict(experts=ex, is_prompt=np.array([True, False, False]), meta={"n_experts": 4})
    d.update(kw)
    return Trace(**d)


@pytest.mark.skipif(not TRACES, reason="no shared traces")
def test_shared_traces_load_and_roundtrip(tmp_path):
    for p in TRACES:
        t = load_trace(p)
        assert t.experts.dtype == np.int16 and t.is_prompt.dtype == bool
        assert t.n_layers == t.meta["n_moe_layers"] and t.top_k == t.meta["top_k"]
        assert t.n_decode == t.meta["n_decode_tokens"]
        save_trace(tmp_path / p.name, t)
        u = load_trace(tmp_path / p.name)
        assert np.array_equal(u.experts, t.experts) and np.array_equal(u.is_prompt, t.is_prompt)
        assert (u.weights is None) == (t.weights is None)
        assert u.meta["source_repo"] == t.meta["source_repo"]


def test_roundtrip_extension_fields(tmp_path):
    t = small(predicted=np.full((3, 2, 3), -1, np.int16), step=np.array([0, 1, 1], np.int32),
              weights=np.ones((3, 2, 2), np.float32))
    t.predicted[1, 0, :2] = [1, 2]
    save_trace(tmp_path / "t.npz", t)
    u = load_trace(tmp_path / "t.npz")
    assert np.array_equal(u.predicted, t.predicted) and u.predicted.dtype == np.int16
    assert np.array_equal(u.step, t.step) and u.step.dtype == np.int32
    assert u.weights.dtype == np.float32
    assert u.meta["n_tokens"] == 3 and u.meta["n_prompt_tokens"] == 1
    assert u.meta["n_decode_tokens"] == 2 and u.meta["top_k"] == 2


def _check_bad_trace(tmp_path, d, mutate, match):
    """``mutate`` the arrays ``d`` of a good trace: loading the file, and saving the Trace, fail
    with one line matching ``match`` (the file name first when loading)."""
    mutate(d)
    arrays = {k: v for k, v in d.items() if k != "meta"}
    f = tmp_path / "bad.npz"
    np.savez(f, meta=np.array(json.dumps(d["meta"])), **arrays)
    with pytest.raises(TraceError, match=match) as ei:
        load_trace(f)
    msg = str(ei.value)
    assert msg.startswith(str(f) + ": ") and "\n" not in msg
    with pytest.raises(TraceError, match=match):
        save_trace(tmp_path / "x.npz", Trace(**d))


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(experts=d["experts"].astype(np.float32)), r"experts: found dtype float32"),
    (lambda d: d["experts"].__setitem__((1, 0, 1), 9), r"experts\[1, 0, 1\]: found 9, expected an expert id < n_experts = 4"),
    (lambda d: d["experts"].__setitem__((0, 0, 0), -3), r"found -3"),
    (lambda d: d.update(experts=d["experts"][0]), r"experts: found shape \(2, 2\)"),
    (lambda d: d.update(is_prompt=np.ones(2, bool)), r"is_prompt: found shape \(2,\), expected \(3,\)"),
    (lambda d: d.update(is_prompt=np.ones(3, np.int8)), r"is_prompt: found dtype int8"),
    (lambda d: d.update(step=np.array([0, 1, 0], np.int32)), r"step: found id 0 in two separate runs"),
    (lambda d: d.update(predicted=np.zeros((3, 1, 2), np.int16)), r"predicted: found shape"),
    (lambda d: d.update(predicted=np.full((3, 2, 1), 7, np.int16)), r"predicted\[0, 0, 0\]: found 7"),
    (lambda d: d.update(weights=np.ones((3, 2, 3), np.float32)), r"weights: found shape"),
    (lambda d: d["meta"].update(n_moe_layers=5), r"meta.n_moe_layers: found 5, expected 2"),
])
def test_validation_errors_name_file_array_value(tmp_path, mutate, match):
    d = dict(experts=small().experts.copy(), is_prompt=small().is_prompt.copy(),
             meta={"n_experts": 4})
    _check_bad_trace(tmp_path, d, mutate, match)


def test_missing_file_array_and_bad_meta(tmp_path):
    with pytest.raises(TraceError, match="file not found"):
        load_trace(tmp_path / "nope.npz")
    np.savez(tmp_path / "a.npz", experts=small().experts)
    with pytest.raises(TraceError, match="is_prompt: found no such array"):
        load_trace(tmp_path / "a.npz")
    np.savez(tmp_path / "b.npz", experts=small().experts, is_prompt=small().is_prompt,
             meta=np.array("{oops"))
    with pytest.raises(TraceError, match="meta: found invalid JSON"):
        load_trace(tmp_path / "b.npz")
    (tmp_path / "c.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match=r"not a trace: expected a \.npz archive"):
        load_trace(tmp_path / "c.npz")


def test_n_experts_inferred_when_meta_lacks_it():
    t = small(meta={})
    assert t.n_experts == 4


def write_jsonl(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines))


def test_convert_token_form(tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [
        {"meta": {"n_experts": 4, "model": "toy"}},
        "# comment",
        {"experts": [[0, 1], [2]], "prompt": True, "weights": [[0.7, 0.3], [1.0]]},
        {"experts": [[1, 3], [2, 0]], "prompt": False, "step": 0,
         "predicted": [[1], [2, 0, 3]]},
    ])
    with pytest.raises(TraceError, match="a step id on every token"):
        convert_jsonl(src)
    write_jsonl(src, [
        {"meta": {"n_experts": 4, "model": "toy"}},
        {"experts": [[0, 1], [2]], "prompt": True, "weights": [[0.7, 0.3], [1.0]]},
        {"experts": [[1, 3], [2, 0]], "prompt": False, "predicted": [[1], [2, 0, 3]]},
    ])
    t = convert_jsonl(src)
    assert t.experts.tolist() == [[[0, 1], [2, -1]], [[1, 3], [2, 0]]]
    assert t.is_prompt.tolist() == [True, False] and t.meta["model"] == "toy"
    assert t.weights[0, 0].tolist() == pytest.approx([0.7, 0.3]) and t.weights[1, 0, 0] == 0
    assert t.predicted.shape == (2, 2, 3) and t.predicted[1, 1].tolist() == [2, 0, 3]
    assert t.predicted[0].tolist() == [[-1, -1, -1], [-1, -1, -1]]


def test_convert_layer_form_and_cli(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    recs = []
    for tok in range(3):
        for l in range(3):
            recs.append({"layer": l, "experts": [tok % 4, (tok + l) % 4 + 0], "prompt": tok == 0,
                         "step": tok // 2})
    recs[4]["experts"] = [3]                          # a short row is padded
    write_jsonl(src, recs)
    out = tmp_path / "out.npz"
    assert convert_main(["convert", str(src), str(out), "--n-experts", "5"]) == 0
    assert "3 tokens" in capsys.readouterr().out
    t = load_trace(out)
    assert t.experts.shape == (3, 3, 2) and t.experts[1, 1].tolist() == [3, -1]
    assert t.step.tolist() == [0, 0, 1] and t.meta["n_experts"] == 5
    # explicit token index: records may interleave
    write_jsonl(src, [{"token": 1, "layer": 0, "experts": [2], "prompt": False},
                      {"token": 0, "layer": 0, "experts": [1], "prompt": True},
                      {"token": 1, "layer": 1, "experts": [3], "prompt": False}])
    t = convert_jsonl(src, n_experts=4)
    assert t.experts[:, :, 0].tolist() == [[2, 3], [1, -1]]


@pytest.mark.parametrize("line,match", [
    ("{bad json", r"in.jsonl:2: invalid JSON"),
    ('{"experts": [[0]], "prompt": "yes"}', r"in.jsonl:2: prompt: found 'yes', expected true or false"),
    ('{"experts": [[0, "a"]], "prompt": true}', r"in.jsonl:2: experts\[0\]: found"),
    ('{"layer": -1, "experts": [0], "prompt": true}', r"in.jsonl:2: layer: found -1"),
    ('{"prompt": true}', r"in.jsonl:2: experts: found absent"),
    ('{"experts": [[9]], "prompt": true}', r"in.jsonl:2: experts of layer 0: found 9, expected an expert id 0..3 \(n_experts = 4\)"),
    ('{"experts": [[0], [1, -2]], "prompt": true}', r"in.jsonl:2: experts of layer 1: found -2"),
    ('{"layer": 0, "experts": [1], "predicted": [7], "prompt": true}', r"in.jsonl:2: predicted of layer 0: found 7"),
    ('{"layer": 5, "experts": [1], "prompt": true}', r"in.jsonl:2: layer: found 5, expected 0..1 \(the trace has 2 MoE layers\)"),
    ('{"layer": 0, "experts": [1, 2], "weights": [0.5], "prompt": true}', r"in.jsonl:2: weights of layer 0: found 1 values, expected 2 numbers"),
    ('{"layer": 0, "experts": [1], "weights": ["x"], "prompt": true}', r"in.jsonl:2: weights of layer 0: found \['x'\], expected a list of numbers"),
    ('{"experts": [[0], [1]], "weights": [[1.0]], "prompt": true}', r"in.jsonl:2: weights: found 1 rows, expected 2 rows"),
])
def test_convert_errors_name_line(tmp_path, line, match):
    """Every bad record is named by file:line, also the range errors found after parsing."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"experts": [[0]], "prompt": true, "meta_x": 1}\n' + line + "\n")
    with pytest.raises(TraceError, match=match):
        convert_jsonl(src, n_experts=4, n_layers=2)


def test_convert_id_beyond_int16_names_line(tmp_path):
    src = tmp_path / "big.jsonl"
    src.write_text('{"experts": [[0, 1]], "prompt": true}\n\n{"experts": [[40000]], "prompt": false}\n')
    with pytest.raises(TraceError, match=r"big.jsonl:3: experts of layer 0: found 40000, expected an expert id 0..32767 \(ids are int16\)"):
        convert_jsonl(src)


def test_recorder_forms_tokens_on_layer_wrap(tmp_path):
    path = tmp_path / "rec.npz"
    rec = TraceRecorder(path, n_layers=3, top_k=2, n_experts=8)
    for tok in range(4):
        for l in range(3):
            rec.record(l, [tok, l + 4], is_prompt=tok < 2, client="a")
    rec.record(0, [7], False, "a")              # a partial token, kept at close
    t = rec.close()
    u = load_trace(path)
    assert u.experts.shape == (5, 3, 2) and np.array_equal(u.experts, t.experts)
    assert u.experts[2, 1].tolist() == [2, 5]
    assert u.experts[4].tolist() == [[7, -1], [-1, -1], [-1, -1]]
    assert u.is_prompt.tolist() == [True, True, False, False, False]
    assert u.meta["clients"] == ["a"] and "token_client" not in u.meta
    with pytest.raises(TraceError, match="recorder closed"):
        rec.record(0, [1], False, "a")


def test_recorder_same_layer_again_starts_a_token_and_rows_widen(tmp_path):
    rec = TraceRecorder(tmp_path / "r.npz", n_layers=2, top_k=2, n_experts=16)
    rec.record(0, [1, 2], True)
    rec.record(0, [3, 4, 5, 6], True)            # batched prefill acquire: widens rows
    rec.record(1, [1], False)
    t = rec.close()
    assert t.experts.shape == (2, 2, 4) and t.experts[0, 0].tolist() == [1, 2, -1, -1]
    assert t.experts[1, 1].tolist() == [1, -1, -1, -1]


def test_recorder_clients_and_filter(tmp_path):
    rec = TraceRecorder(tmp_path / "r.npz", n_layers=2, top_k=1, n_experts=4)
    rec.record(0, [0], False, "a")
    rec.record(0, [1], False, "b")               # interleaved clients keep separate tokens
    rec.record(1, [2], False, "a")
    rec.record(1, [3], False, "b")
    rec.record(0, [1], False, "a")               # a's first token ends here
    t = rec.close()
    assert t.experts[:, :, 0].tolist() == [[0, 2], [1, 3], [1, -1]]
    assert t.meta["clients"] == ["a", "b"] and t.meta["token_client"] == [0, 1, 0]
    only = TraceRecorder(tmp_path / "o.npz", n_layers=2, top_k=1, n_experts=4, client="b")
    only.record(0, [0], False, "a")
    only.record(0, [1], False, "b")
    assert only.close().experts[:, 0, 0].tolist() == [1]


def test_recorder_errors_and_threads(tmp_path):
    rec = TraceRecorder(tmp_path / "r.npz", n_layers=2, top_k=1, n_experts=4)
    with pytest.raises(TraceError, match="layer_idx: found 2, expected 0..1"):
        rec.record(2, [0], False)
    with pytest.raises(TraceError, match="expert: found 4, expected 0..3"):
        rec.record(0, [4], False)
    with pytest.raises(TraceError, match="expected all >= 1"):
        TraceRecorder(tmp_path / "x.npz", 0, 1, 1)

    def worker(name):
        for _ in range(200):
            rec.record(0, [1], False, name)
            rec.record(1, [2], False, name)

    ts = [threading.Thread(target=worker, args=(f"c{i}",)) for i in range(4)]
    [x.start() for x in ts]
    [x.join() for x in ts]
    t = rec.close()
    assert t.n_tokens == 800 and (t.experts[:, :, 0] == [1, 2]).all()


# -- garbage in: one-line TraceError naming the file ---------------------------------------------

def _garbage(tmp_path, kind):
    import zipfile
    p = tmp_path / f"{kind}.npz"
    if kind == "text":
        p.write_text("root:x:0:0:root:/root:/bin/bash\n")
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "dir":
        p.mkdir()
    elif kind == "npy":
        with open(p, "wb") as fh:
            np.save(fh, np.zeros(3))
    elif kind == "pickle":
        import pickle
        p.write_bytes(pickle.dumps({"experts": [1, 2]}))
    elif kind == "object":
        np.savez(p, experts=np.array([{"a": 1}], dtype=object), is_prompt=np.zeros(1, bool))
    elif kind == "other":
        np.savez(p, foo=np.zeros(3))
    elif kind == "zip":
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("word/document.xml", "<x/>")
    elif kind == "truncated":
        save_trace(p, small())
        p.write_bytes(p.read_bytes()[:60])
    elif kind == "crc":
        np.savez(p, experts=np.zeros((50, 2, 2), np.int16), is_prompt=np.zeros(50, bool))
        b = bytearray(p.read_bytes())
        b[b.find(b"\x93NUMPY") + 200] ^= 0xFF
        p.write_bytes(bytes(b))
    elif kind == "big_ids":
        np.savez(p, experts=np.full((2, 1, 1), 40000, np.int32), is_prompt=np.zeros(2, bool))
    elif kind == "meta_not_json":
        np.savez(p, experts=np.zeros((2, 1, 1), np.int16), is_prompt=np.zeros(2, bool),
                 meta=np.array("{not json"))
    return p


GARBAGE = {
    "text": "not a trace: expected a .npz archive (docs/trace-format.md)",
    "empty": "empty file (0 bytes), expected a .npz archive (docs/trace-format.md)",
    "dir": "is a directory, expected a .npz archive (docs/trace-format.md)",
    "npy": "not a trace: a single .npy array, expected a .npz archive (docs/trace-format.md)",
    "pickle": "not a trace: expected a .npz archive (docs/trace-format.md)",
    "object": "experts: found an object (pickled) array, expected a numeric array (pickles are "
              "never loaded)",
    "other": "not a trace: found arrays [foo], expected arrays experts and is_prompt "
             "(docs/trace-format.md)",
    "zip": "not a trace: found arrays [word/document.xml], expected arrays experts and "
           "is_prompt (docs/trace-format.md)",
    "truncated": "not a trace: unreadable archive (BadZipFile: ",
    "crc": "experts: found an unreadable array (BadZipFile: Bad CRC-32",
    "big_ids": "experts[0, 0, 0]: found 40000, expected an expert id < 32768 (ids are int16)",
    "meta_not_json": "meta: found invalid JSON (JSONDecodeError: ",
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_load_trace_garbage_one_line(tmp_path, kind):
    p = _garbage(tmp_path, kind)
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{p}: {GARBAGE[kind]}"), msg
    assert "allow_pickle" not in msg


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_load_trace_not_a_regular_file():
    with pytest.raises(TraceError) as ei:
        load_trace("/dev/null")
    assert str(ei.value) == ("/dev/null: not a regular file (a character device), expected a .npz archive "
                             "(docs/trace-format.md)")


def test_window_and_step_starts():
    """Trace.window cuts every per-token array alike, keeps meta but the token counts, pins
    n_experts; step_starts gives the steps' first tokens then n_tokens."""
    rng = np.random.default_rng(0)
    T, L, K = 9, 3, 2
    ex = rng.integers(0, 5, size=(T, L, K)).astype(np.int16)
    t = Trace(experts=ex, is_prompt=np.arange(T) < 3, weights=rng.random((T, L, K), dtype=np.float32),
              predicted=ex[:, :, :1].copy(), step=np.array([0, 0, 0, 1, 2, 2, 3, 4, 4], np.int32),
              meta={"model": "m", "n_tokens": T, "n_decode_tokens": 6, "n_experts": 64})
    assert t.step_starts().tolist() == [0, 3, 4, 6, 7, 9]
    w = t.window(2, 7)
    assert w.n_tokens == 5 and (w.experts == ex[2:7]).all() and (w.weights == t.weights[2:7]).all()
    assert (w.predicted == t.predicted[2:7]).all() and w.is_prompt.tolist() == [True, False, False, False, False]
    assert w.step.tolist() == [0, 1, 2, 2, 3] and w.step_starts().tolist() == [0, 1, 2, 4, 5]
    assert w.meta == {"model": "m", "n_experts": 64}
    lay = t.window(layers=2)
    assert lay.experts.shape == (T, 2, K) and lay.experts.flags.c_contiguous
    assert lay.meta["n_moe_layers"] == 2 and (lay.experts == ex[:, :2]).all()
    no_step = Trace(experts=ex, is_prompt=np.zeros(T, bool))
    assert no_step.step_starts().tolist() == list(range(T + 1))
    assert no_step.window(4).n_experts == no_step.n_experts   # pinned: the window's ids may not reach it
    w.validate()


def candidate_arrays():
    """Substitution arrays for :func:`small` (3 tokens, 2 layers, top-2, 4 experts)."""
    sc = np.array([[[0.6, 0.3], [0.9, 0.0]], [[0.5, 0.4], [0.7, 0.2]], [[0.8, 0.1], [0.6, 0.3]]],
                  np.float32)
    cand = np.full((3, 2, 2), -1, np.int16)
    cs = np.zeros((3, 2, 2), np.float32)
    cand[0, 0] = [2, 3]
    cs[0, 0] = [0.25, 0.125]
    cand[2, 1, 0] = 0
    cs[2, 1, 0] = 0.2
    return dict(scores=sc, candidates=cand, candidate_scores=cs)


def test_roundtrip_and_window_keep_substitution_candidates(tmp_path):
    t = small(**candidate_arrays())
    save_trace(tmp_path / "t.npz", t)
    u = load_trace(tmp_path / "t.npz")
    for k in ("scores", "candidates", "candidate_scores"):
        assert np.array_equal(getattr(u, k), getattr(t, k)), k
    assert u.candidates.dtype == np.int16 and u.scores.dtype == np.float32
    assert u.candidate_scores.dtype == np.float32
    w = u.window(1, 3, layers=1)
    assert np.array_equal(w.scores, t.scores[1:3, :1])
    assert np.array_equal(w.candidates, t.candidates[1:3, :1])
    assert np.array_equal(w.candidate_scores, t.candidate_scores[1:3, :1])
    assert w.candidates.flags.c_contiguous
    plain = load_trace(tmp_path / "t.npz").window(0, 2)
    assert small().window(0, 2).candidates is None and plain.candidates is not None


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(scores=d["scores"][:, :, :1]), r"scores: found shape \(3, 2, 1\), expected \(3, 2, 2\)"),
    (lambda d: d.update(scores=d["scores"].astype(np.int32)), r"scores: found dtype int32, expected float32"),
    (lambda d: d["scores"].__setitem__((1, 0, 1), np.nan), r"scores\[1, 0, 1\]: found nan, expected a finite router score >= 0"),
    (lambda d: d["candidate_scores"].__setitem__((2, 1, 0), -0.5), r"candidate_scores\[2, 1, 0\]: found -0.5, expected a finite"),
    (lambda d: d["candidates"].__setitem__((0, 0, 1), 9), r"candidates\[0, 0, 1\]: found 9, expected an expert id < n_experts = 4"),
    (lambda d: d["candidates"].__setitem__((0, 1, 1), -2), r"candidates\[0, 1, 1\]: found -2"),
    (lambda d: d.update(candidates=d["candidates"][:, :1]), r"candidates: found shape \(3, 1, 2\), expected \(3, 2, k_cand\)"),
    (lambda d: d.update(candidates=d["candidates"].astype(np.float32)), r"candidates: found dtype float32, expected int16"),
    (lambda d: d.pop("candidate_scores"), r"candidate_scores: found no such array, expected 'candidate_scores' beside 'candidates'"),
    (lambda d: d.pop("scores"), r"scores: found no such array, expected 'scores' beside 'candidates'"),
    (lambda d: d.pop("candidates"), r"candidates: found no such array, expected 'candidates' beside 'candidate_scores'"),
    (lambda d: d.update(candidate_scores=d["candidate_scores"][:, :, :1]), r"candidate_scores: found shape \(3, 2, 1\), expected \(3, 2, 2\) \(candidates.shape\)"),
])
def test_candidate_validation_errors_name_file_array_value(tmp_path, mutate, match):
    d = dict(experts=small().experts.copy(), is_prompt=small().is_prompt.copy(),
             meta={"n_experts": 4}, **candidate_arrays())
    _check_bad_trace(tmp_path, d, mutate, match)


def test_recorder_stores_scores_and_candidates(tmp_path):
    rec = TraceRecorder(tmp_path / "r.npz", n_layers=2, top_k=2, n_experts=8)
    rec.record(0, [1, 2], False, scores=[0.5, 0.25], candidates=[(3, 0.375), (4, 0.125), (5, 0.0625)])
    rec.record(1, [6, 7], False)                          # no offer: -1 / 0
    rec.record(0, [2, 3], False, scores=[0.75, 0.5])      # scores, no candidates
    t = rec.close()
    u = load_trace(tmp_path / "r.npz")
    for x in (t, u):
        assert x.candidates.shape == (2, 2, 3)
        assert x.candidates[0, 0].tolist() == [3, 4, 5]
        assert x.candidate_scores[0, 0].tolist() == [0.375, 0.125, 0.0625]
        assert x.scores[0, 0].tolist() == [0.5, 0.25] and x.scores[1, 0].tolist() == [0.75, 0.5]
        assert (x.candidates[0, 1] == -1).all() and (x.candidates[1] == -1).all()
        assert (x.scores[0, 1] == 0).all() and (x.candidate_scores[1] == 0).all()
    plain = TraceRecorder(tmp_path / "p.npz", n_layers=1, top_k=1, n_experts=2)
    plain.record(0, [1], False)
    p = plain.close()
    assert p.scores is None and p.candidates is None and p.candidate_scores is None
    with pytest.raises(TraceError, match="TraceRecorder.record: scores: found 1, expected 2"):
        TraceRecorder(tmp_path / "e.npz", 1, 2, 8).record(0, [1, 2], False, scores=[0.5])
    with pytest.raises(TraceError, match="TraceRecorder.record: candidate: found 8, expected 0..7"):
        TraceRecorder(tmp_path / "e.npz", 1, 2, 8).record(0, [1, 2], False, scores=[1, 1],
                                                          candidates=[(8, 0.5)])
