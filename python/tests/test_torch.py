"""gradpack.torch: every scheme as a DDP communication hook on real gloo
ranks (separate processes started as torchrun starts them), against
allreduce_ on the same gradients and against the 'device' store with one
device per rank; DDP's options; start_iter and min_compression_rate;
checkpoints; faults. The ranks are dist_scripts/torch_ddp.py."""
import os
import subprocess
import sys

import pytest

from torch_ranks import free_port, ranks, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMES = ["none", "2bit", "qsgd_mn", "qsgd_mn_ts", "qsgd_mn_ms", "grandk_mn", "grandk_mn_ts", "powersgd", "1bit"]
# Float32 sums (no compression, PowerSGD's factors) are gloo's: with 3 ranks
# their rounding depends on where a tensor sits in the buffer summed.
FLOAT_SUMMED = ("none", "powersgd")


@pytest.fixture(scope="module", params=[2, 3])
def main_run(request, tmp_path_factory):
    world = request.param
    return world, ranks(world, ["schemes", "ddp_options", "start_and_rate", "resume"], tmp_path_factory.mktemp("torch%d" % world))


def exact(world, name):
    return world == 2 or name.split()[0] not in FLOAT_SUMMED


def test_every_scheme_matches_allreduce_and_the_device_store(main_run):
    world, reports = main_run
    for rep in reports:
        assert sorted(rep["schemes"]) == sorted(SCHEMES)
        for name, s in rep["schemes"].items():
            assert s["replicas_identical"], (name, s)
            limit = 0.0 if exact(world, name) else 1e-6
            assert s["max_diff_vs_allreduce"] <= limit, (world, name, s)
            if rep["rank"] == 0:
                assert s["device_store_max_diff"] <= limit, (world, name, s)
            st = s["stats"]
            assert st["steps"] == 3 and st["bytes_uncompressed"] == 3 * 4 * 5010, st
            if name == "none":
                assert st["compressed_steps"] == 0 and st["bytes_uncompressed"] < st["bytes_sent"] < 1.05 * st["bytes_uncompressed"], st
            else:
                assert st["compressed_steps"] == 3 and st["bytes_sent"] * 2 < st["bytes_uncompressed"], (name, st)


def test_ddp_options_buckets_and_half_precision(main_run):
    world, reports = main_run
    for rep in reports:
        names = rep["ddp_options"]
        assert len(names) == 3 * 7, sorted(names)
        for name, s in names.items():
            assert s["replicas_identical"], (name, s)
            limit = 0.0 if exact(world, name) else 1e-6
            if "float16" in name or "bfloat16" in name:
                limit = 0.0 if exact(world, name) else 1e-2  # rounded to half after the sum
            assert s["max_diff_vs_allreduce"] <= limit, (world, name, s)
            assert s["stats"]["compressed_steps"] == 3, (name, s)
        # the unused layer's 30 values go through the hook too (as zeros)
        assert names["2bit find_unused"]["stats"]["bytes_uncompressed"] == 3 * 4 * 5040


def test_start_iter_and_min_compression_rate(main_run):
    world, reports = main_run
    for rep in reports:
        s = rep["start_and_rate"]
        assert s["start_iter"]["stats"]["steps"] == 4 and s["start_iter"]["stats"]["compressed_steps"] == 2, s
        assert s["start_iter"]["plain_diff"] <= (0.0 if world == 2 else 1e-6), s
        huge = s["min_rate_huge"]
        assert huge["compressed_steps"] == 0 and huge["bytes_uncompressed"] < huge["bytes_sent"] < 1.05 * huge["bytes_uncompressed"], huge
        d = s["min_rate_default"]
        assert d["max_diff_vs_allreduce"] == 0.0 and d["stats"]["compressed_steps"] == 3, d


def test_checkpoint_resume_continues_bit_for_bit(main_run):
    world, reports = main_run
    for rep in reports:
        for name, diff in rep["resume"].items():
            assert diff <= (0.0 if exact(world, name) else 1e-6), (world, name, diff)


def test_faults_raise_the_same_error_on_every_rank(tmp_path):
    reports = ranks(3, ["faults"], tmp_path)
    for scheme in ("2bit", "qsgd_mn", "grandk_mn", "powersgd"):
        errors = {rep["faults"]["nan " + scheme] for rep in reports}
        assert len(errors) == 1, errors  # the same text on every rank
        err = errors.pop()
        assert err.startswith("gradpack.Error: gradpack: rank 2's") and "non-finite" in err and "nothing was applied on any rank" in err, err
        assert all(rep["faults"]["nan unchanged " + scheme] for rep in reports)
    for what, needle in [("mismatch", "disagree on compression parameters"), ("layout", "disagree on bucket layout")]:
        errors = {rep["faults"][what] for rep in reports}
        assert len(errors) == 1 and needle in errors.pop(), (what, errors)
    for rep in reports:
        f = rep["faults"]
        assert "gradpack.Error" in f["load other compression"] and "qsgd_mn_ts" in f["load other compression"], f
        assert "saved with shape [3, 4], initialized here with [4, 3]" in f["load other shape"], f
        assert f["load other shape unchanged"], f
        assert "'bits': 'qsgd_mn_ts' takes two values" in f["bad params"], f
        assert "'unselected'" in f["local unselected"] and "replicas would differ" in f["local unselected"], f
        assert "CPU tensors only" in f["meta tensor"], f
    for rep in reports[:2]:
        assert "worker %d of 3, this is worker %d of 2" % (rep["rank"], rep["rank"]) in rep["faults"]["load other world"], rep
    # Input refused on the last rank alone: the same error on every rank (that
    # rank adds its own reason), states unchanged, and the job goes on.
    reasons = {"dtype": ("its dtype is not one gradpack compresses", "torch.float64"),
               "key": ("not a key gradpack takes", "holds a NUL character"),
               "expanded": ("its elements share memory", "strides (0, 1)"),
               "dims": ("does not hold the tensors it names", "33 dimensions")}
    for what, (common, own) in reasons.items():
        errors = [rep["faults"]["refused " + what] for rep in reports]
        head = "gradpack.Error: gradpack: rank 2's key " + ("at tensor 0 of its bucket" if what == "key" else "'w'")
        assert all(e.startswith(head) and common in e and "nothing was applied on any rank" in e for e in errors), errors
        assert own in errors[2] and not any(own in e for e in errors[:2]), errors
        assert errors[0] == errors[1] and errors[2].startswith(errors[0]), errors
        for rep in reports:
            f = rep["faults"]
            assert f["refused unchanged " + what] and f["refused then " + what] is None, (what, f)
            assert f["refused then identical " + what], what
    for name, needle in [("state args", "rank 2: invalid parameter 'bits'"), ("state start_iter", "rank 2: start_iter must be")]:
        errors = {rep["faults"][name] for rep in reports}
        assert len(errors) == 1 and needle in errors.pop(), (name, errors)
    for scheme in ("2bit", "qsgd_mn", "1bit"):
        errors = {rep["faults"]["nan one param " + scheme] for rep in reports}
        assert len(errors) == 1 and "rank 2's" in errors.pop(), (scheme, errors)
        assert all(rep["faults"]["nan one param unchanged " + scheme] for rep in reports), scheme


def test_a_dead_rank_ends_the_job_with_torchs_error(tmp_path):
    reports = ranks(2, ["dead_rank"], tmp_path, timeout=120, GRADPACK_TEST_TIMEOUT="10")
    assert reports[1] is None  # it left after one step
    err = reports[0]["dead_rank"]["error"]
    assert err is not None and err.startswith("RuntimeError") and ("Connection" in err or "timed out" in err.lower()), err


def test_the_example_trains_under_torchrun():
    out = torchrun(2, "examples/torch_ddp.py", ["--compress", "qsgd_mn", "--bits", "2", "--epochs", "3"])
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    lines = out.stdout.splitlines()
    accuracy = next(float(l.split()[2].rstrip("%")) for l in lines if l.startswith("test accuracy"))
    fewer = next(float(l.split("(")[1].split("x")[0]) for l in lines if l.startswith("bytes sent"))
    assert accuracy > 85 and fewer > 5, lines
    assert any(l.endswith("ms per step") for l in lines), lines


@pytest.mark.parametrize("world", [2, 4])
def test_every_scheme_trains_within_two_points_of_uncompressed(world):
    # The mean of 3 seeds' final accuracies: one run's, on 360 test images,
    # moves by up to 4 points with the seed (docs/torch.md, Convergence).
    out = torchrun(world, "benches/torch_convergence.py", ["--check", "2.0", "--seeds", "3"], timeout=1800)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    rows = [l for l in out.stdout.splitlines() if "%" in l]
    assert len(rows) == len(SCHEMES), out.stdout


def test_powersgd_draws_a_collapsed_q_anew_for_a_lora_adapter_and_after_a_spike(tmp_path):
    # LoRA's B starts at zero, so A's first gradient is zero and PowerSGD's Q
    # for A collapses; torch's own powerSGD_hook stays at zero (or NaN) from
    # there. gradpack draws Q anew from (seed, step, key) on every rank: A's
    # gradient through the hook follows plain DDP's.
    for report in ranks(2, ["powersgd_recovery"], tmp_path):
        r = report["powersgd_recovery"]
        assert "gradpack.Error" in r["overflow"] and "sum of P holds" in r["overflow"], r["overflow"]
        assert r["overflow unchanged"] and r["overflow then"] is None, r
        for case in ("lora", "spike"):
            r = report["powersgd_recovery"][case]
            assert r["finite"] and r["replicas_identical"], (case, r)
            if case == "lora":
                assert r["a_grad"][0] == 0.0 and r["plain_a_grad"][0] == 0.0, (case, r)
            for step in range(1, 6):
                # rank 1 of a 4 x 32 gradient: a good share of plain DDP's size
                assert r["a_grad"][step] > 0.2 * r["plain_a_grad"][step] > 0, (case, step, r)

SOLO = """
import copy, os, pickle, sys, tempfile, threading
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
import gradpack, gradpack.torch as gpt

def refused(f, *args):
    try:
        f(*args)
    except gradpack.Error as e:
        return str(e)
    raise AssertionError("%s%r was not refused" % (f.__name__, args))
"""


def solo(code, timeout=120):
    """Runs `code` in a process of its own holding a one-rank gloo group
    (a crash there, such as a double free, fails the test instead of pytest);
    asserts that it exits 0 and prints 'done' last."""
    r = subprocess.run([sys.executable, "-c", SOLO + code + "\nprint('done')\n"], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and r.stdout.endswith("done\n"), (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return r.stdout


def test_a_state_and_a_pending_bucket_refuse_copies_and_pickling():
    solo("""
state = gpt.State({"compress": "1bit"})
t = torch.arange(12, dtype=torch.float32)
gpt.allreduce_(t, state, "w")
for f in (copy.copy, copy.deepcopy, pickle.dumps):
    err = refused(f, state)
    assert err.startswith("a gradpack.torch.State cannot be ") and "state_dict()" in err and "load_state_dict()" in err, err
pending = state._encode(torch.ones(12), ["w"], [(12,)], True)
for f in (copy.copy, copy.deepcopy, pickle.dumps):
    err = refused(f, pending)
    assert err.startswith("a gradpack.torch._Pending cannot be ") and "decoded once" in err, err
for fut in pending.futures:
    fut.wait()
pending.decode()
del pending
# The original works on, resumes from its state_dict, and is freed once.
saved = state.state_dict()
again = torch.arange(12, dtype=torch.float32)
gpt.allreduce_(again, state, "w")
resumed = gpt.State({"compress": "1bit"})
resumed.load_state_dict(saved)
other = torch.arange(12, dtype=torch.float32)
gpt.allreduce_(other, resumed, "w")
assert torch.equal(again, other), (again, other)
del state, resumed
import gc; gc.collect()
""")


def test_names_and_settings_that_ctypes_would_cut_or_wrap_are_refused():
    solo("""
state = gpt.State({"compress": "1bit"})
err = refused(gpt.allreduce_, torch.ones(4), state, "a\\0b")
assert "key 'a\\\\x00b' holds a NUL character (at index 1): it would name the state of 'a'" in err, err
assert state.state_dict()["states"] == gpt.State({"compress": "1bit"}).state_dict()["states"]  # nothing registered
for start in (2**64, 2**64 + 3, -1):
    err = refused(gpt.State, {"compress": "1bit"}, None, start)
    assert err == "start_iter must be a whole number from 0 to 2**64 - 1, got %r" % start, err
gpt.State({"compress": "1bit"}, start_iter=2**64 - 1)
for rate in (10**400, "x", float("nan"), float("inf"), -1.0):
    err = refused(gpt.State, {"compress": "1bit"}, None, 0, rate)
    assert "min_compression_rate" in err and "must be a finite number >= 0" in err, (rate, err)
err = refused(gpt.State, {"compress": "qsgd_mn\\0", "bits": 2})
assert "compress_params value 'qsgd_mn\\\\x00' holds a NUL character" in err, err
err = refused(gpt.State, {"compress": "qsgd_mn", "bits\\0x": 2})
assert "compress_params key 'bits\\\\x00x' holds a NUL character" in err, err
""")


def test_a_state_used_by_two_threads_at_once_is_refused():
    """One thread is inside the State's agreement (its all-reduce held back);
    a second call from another thread is refused, and the first completes."""
    solo("""
class Held(gpt.State):
    def _reduce(self, *args):
        entered.set()
        assert release.wait(60)
        return gpt.State._reduce(self, *args)

entered, release = threading.Event(), threading.Event()
state = Held({"compress": "1bit"})
t = torch.arange(8, dtype=torch.float32)
first = threading.Thread(target=gpt.allreduce_, args=(t, state, "a"))
first.start()
assert entered.wait(60)
err = refused(gpt.allreduce_, torch.ones(8), state, "b")
assert err.startswith("gradpack.torch.State used by two threads at once"), err
release.set()
first.join(60)
assert not first.is_alive()
# As if only the first call had been made: its result, and no key 'b'.
ref, want = gpt.State({"compress": "1bit"}), torch.arange(8, dtype=torch.float32)
gpt.allreduce_(want, ref, "a")
assert torch.equal(t, want) and state.state_dict()["states"] == ref.state_dict()["states"], (t, want)
""")


def test_a_settled_job_runs_no_agreement_and_issues_only_the_schemes_all_reduces(tmp_path):
    # Blocking rounds a bucket makes before its final sums, by scheme.
    rounds = {"none": 0, "2bit": 0, "1bit": 0, "qsgd_mn": 1, "grandk_mn": 1, "powersgd": 1,
              "qsgd_mn_ts": 2, "qsgd_mn_ms": 2, "grandk_mn_ts": 2}
    for rep in ranks(2, ["steady"], tmp_path):
        for name, s in rep["steady"].items():
            assert s["replicas_identical"], (name, s)
            # Step 0 agrees its one bucket; DDP then rebuilds its buckets, so
            # step 1 agrees each new bucket and step 2 the first after the
            # last; from step 3 on every bucket is the one planned.
            assert s["agreements"][2:] == [s["agreements"][2]] * 4 and s["agreements"][1] > s["agreements"][0], (name, s)
            for step in range(3, 6):
                # The words (codes and the check), the floats or the bucket, and the scheme's own rounds.
                assert s["hooks"][step] <= s["collectives"][step] <= s["hooks"][step] * (2 + rounds[name]), (name, s)
                assert s["collectives"][step] == s["collectives"][3], (name, s)


def test_a_rank_that_departs_from_a_settled_job_fails_every_rank_alike(tmp_path):
    reports = ranks(3, ["departures"], tmp_path)
    for key in reports[0]["departures"]:
        if key.startswith(("load one ", "late nan ", "other layout")) and not any(w in key for w in ("unchanged", "agreements", "identical", "then")):
            errors = {rep["departures"][key] for rep in reports}
            assert len(errors) == 1, (key, errors)
    for rep in reports:
        d = rep["departures"]
        assert "the ranks disagree on bucket layout" in d["other layout"], d["other layout"]
        assert d["other layout unchanged"] and d["other layout agreements"] == 0, d
        assert d["other layout then"] is None and d["other layout then identical"], d
        for name in ("2bit", "qsgd_mn", "qsgd_mn_ts", "powersgd", "1bit"):
            assert "the ranks disagree on push counts" in d["load one " + name], (name, d["load one " + name])
            assert d["load one unchanged " + name], name
            assert d["load all " + name] is None and d["load all identical " + name], (name, d["load all " + name])
            err = d["late nan " + name]
            assert err.startswith("gradpack.Error: gradpack: rank 2's") and "non-finite" in err, (name, err)
            assert d["late nan unchanged " + name], name


@pytest.mark.parametrize("world", [4, 8])
def test_the_hierarchical_exchange_matches_its_parts_and_fails_alike(world, tmp_path):
    # Nodes of 2 ranks grouped by rank number (2 x 2 and 4 x 2).
    reports = ranks(world, ["hierarchical"], tmp_path, timeout=600)
    for rep in reports:
        h = rep["hierarchical"]
        for scheme in SCHEMES:
            facts = h[scheme]
            assert facts["max_diff_vs_by_hand"] == 0.0, (scheme, facts)
            # Float32 sums over more than 2 nodes round by gloo's buffer lengths,
            # which differ between DDP's first buckets and its rebuilt ones.
            limit = 0.0 if exact(world // 2, scheme) else 1e-6
            assert facts["replicas_identical"] and facts["resume_diff"] <= limit, (scheme, facts)
            s = facts["stats"]
            assert s["hierarchical"] and s["local_size"] == 2 and s["bytes_within_node"] > 0, s
        assert h["nan unchanged"], h
        assert h["owners across nodes"] == 0.0 and h["stats owners"]["exchange"] == "owners", h["stats owners"]
        assert h["stats owners"]["hierarchical"] and h["stats lanes"]["exchange"] == "lanes", h["stats lanes"]
        assert "layout" not in h["load flat"] and "saved by the hierarchical exchange over %d nodes of 2 ranks; this State runs the flat exchange over %d ranks" % (world // 2, world) in h["load flat"], h
        assert "local_size %d does not divide the world of %d ranks" % (world - 1, world) in h["not dividing"], h
        assert "needs the default process group" in h["subgroup"], h
        assert h["then"] is None, h["then"]
        assert "this state_dict was saved by rank %d; this is rank %d" % (rep["rank"] ^ 1, rep["rank"]) in h["load peer"], h
        assert len(set(h["timeouts"])) == 1 and h["timeouts"][0] != "0:30:00", h["timeouts"]
    for what in ("nan", "other sizes", "not dividing", "load flat", "key by local", "shape by local", "settings by local",
                 "start_iter by local", "dims one rank"):
        errors = {rep["hierarchical"][what].split(" (on this rank:")[0] for rep in reports}
        assert len(errors) == 1 and errors.pop().startswith("gradpack.Error"), (what, errors)
    for what in ("key by local", "shape by local", "settings by local", "start_iter by local"):
        assert "the ranks of its node disagree" in reports[0]["hierarchical"][what], reports[0]["hierarchical"][what]
    dims = reports[-1]["hierarchical"]["dims one rank"]
    assert "was refused there: its buffer does not hold" in dims and "33 dimensions" in dims, dims
    nan = reports[0]["hierarchical"]["nan"]
    assert "non-finite" in nan and "nothing was applied" in nan, nan
    assert "different local_size values" in reports[0]["hierarchical"]["other sizes"]


def owners_bytes(world, width, wide, n=1 << 20):
    """Bytes a rank hands torch a step for one tensor of `n` codes of
    `width` bits under the owners exchange: its codes (whole lane groups
    of 8 words) in `world` runs, then its run's sums again in lanes of
    `wide` bits, and the check's 39 words."""
    per = 64 // width
    words = -(-n // per)
    run = -(-(-(-words // 8) * 8) // world)
    run = -(-run // 8) * 8
    counts = [max(0, min(n, (r + 1) * run * per) - r * run * per) for r in range(world)]
    return 8 * (world * run + max(-(-c // (64 // wide)) for c in counts) + 39)


def width_for(v):
    return max(1, v.bit_length())


@pytest.fixture(scope="module")
def owners_runs(tmp_path_factory):
    return {world: ranks(world, ["owners"], tmp_path_factory.mktemp("owners%d" % world), timeout=900)
            for world in (2, 4, 8, 16)}


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_the_owners_exchange_keeps_replicas_identical_and_fails_alike(owners_runs, world):
    for rep in owners_runs[world]:
        o = rep["owners"]
        for key, facts in o.items():
            if isinstance(facts, dict) and "bytes_per_step" in facts:
                assert facts["identical"] and facts["exchange"] == key.split()[-1], (world, key, facts)
        lanes, owners = o["2bit reference lanes"], o["2bit reference owners"]
        assert lanes["max_diff"] == 0.0 and lanes["identical"], lanes  # the exact sum
        assert owners["identical"], owners
        if world <= 8:  # the owners' exact sums: the lanes' bits
            assert owners["max_diff"] == 0.0, owners
        else:  # the mean to an eighth of a code step (+pos and neg apart), unbiased
            assert 0 < owners["max_diff"] <= 2 * 0.5 / 8 and owners["moved"] > 100, owners
            assert abs(owners["mean_shift"]) < 0.01, owners
        for scheme in ("2bit", "qsgd_mn_ts"):
            d = o["ddp " + scheme]
            assert d["identical"] and d["resume_diff"] == 0.0, (scheme, d)
        assert o["nan unchanged"] and "rank %d's" % (world - 1) in o["nan"] and "non-finite" in o["nan"], o["nan"]
        assert "'owners' sums integer codes; powersgd sends float32" in o["powersgd owners"], o
        assert "must be 'lanes', 'owners' or 'auto'" in o["bad exchange"], o
    assert len({rep["owners"]["nan"] for rep in owners_runs[world]}) == 1  # the same text everywhere


def test_the_owners_exchange_hands_torch_bytes_that_do_not_grow_with_the_ranks(owners_runs):
    per = {w: owners_runs[w][0]["owners"] for w in owners_runs}
    # 2-bit's and 1-bit's codes are all they send: the formula exactly.
    for w in per:
        d = min(w, 8)  # the owners send sums of up to 8 members' codes
        assert per[w]["2bit owners"]["bytes_per_step"] == owners_bytes(w, 2, width_for(d * (d + 1))), w
        assert per[w]["1bit owners"]["bytes_per_step"] == owners_bytes(w, 1, width_for(d)), w
    for scheme in ("2bit", "1bit", "qsgd_mn", "qsgd_mn_ts", "qsgd_mn_ms", "grandk_mn", "grandk_mn_ts"):
        two = per[2][scheme + " lanes"]["bytes_per_step"]
        # The goal: at 16 ranks within 1.25x of the lanes' 2-rank bytes...
        assert per[16][scheme + " owners"]["bytes_per_step"] <= 1.25 * two, (scheme, per[16][scheme + " owners"], two)
        # ...where the lanes grow past it.
        assert per[16][scheme + " lanes"]["bytes_per_step"] > 1.25 * two, scheme
