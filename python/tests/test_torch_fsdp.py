"""gradpack.torch.fsdp: every scheme in FSDP2's reduce-scatter on real
gloo ranks (separate processes started as torchrun starts them), a small
CNN with one FSDP unit per layer and the root; each rank's gradient shard
against its rows of gradpack.torch.allreduce_ on the same gradients under
the same keys; bf16 reduce_dtype, accumulation, resume (torch.save and
torch.distributed.checkpoint), a NaN on one rank, refusals; the digits CNN
under FSDP2 with every scheme within two points of uncompressed (the mean of 3 seeds); HSDP (2
replicas x 2 shards, gradpack across the replicas). The ranks are
dist_scripts/torch_fsdp.py."""
import pytest

from torch_ranks import ranks, torchrun

SCHEMES = ["none", "2bit", "qsgd_mn", "qsgd_mn_ts", "qsgd_mn_ms", "grandk_mn", "grandk_mn_ts", "powersgd", "1bit"]
# Float32 sums (no compression, PowerSGD's factors) are gloo's: beyond 2
# ranks their rounding depends on where a tensor sits in the buffer summed.
FLOAT_SUMMED = ("none", "powersgd")


@pytest.fixture(scope="module", params=[2, 4])
def schemes_run(request, tmp_path_factory):
    world = request.param
    return world, ranks(world, ["schemes"], tmp_path_factory.mktemp("fsdp%d" % world), timeout=600,
                        script="torch_fsdp.py")


def test_every_scheme_gives_each_rank_its_rows_of_allreduce(schemes_run):
    world, reports = schemes_run
    for rep in reports:
        assert sorted(rep["schemes"]) == sorted(SCHEMES)
        for name, s in rep["schemes"].items():
            assert s["identical"], (world, name)
            limit = 0.0 if world == 2 or name not in FLOAT_SUMMED else 1e-6
            assert s["max_diff_vs_allreduce"] <= limit, (world, name, s)
            st = s["stats"]
            if name == "none":
                # FSDP2's own reduce-scatter, untouched.
                assert st["exchange"] == "fsdp" and st["steps"] == 0, st
                continue
            assert st["exchange"] == "scatter", st
            # Three FSDP units with parameters (conv, fc1, fc2; the root holds none), 3 steps.
            assert st["steps"] == 9, (name, st)
            assert st["compressed_steps"] == 9 and st["bytes_sent"] * 2 < st["bytes_uncompressed"], (name, st)


def test_options_resume_faults_and_refusals(tmp_path):
    reports = ranks(2, ["options"], tmp_path, timeout=600, script="torch_fsdp.py")
    errors = set()
    for rep in reports:
        o = rep["options"]
        for name in ("2bit", "qsgd_mn_ts"):
            assert o[name + " bf16"] == 0.0, (name, o)
            assert o[name + " accumulate"] == 0.0, (name, o)
            assert o[name + " accumulate steps"] == 2 * 3, (name, o)
            assert o[name + " resume"] == 0.0, (name, o)
            assert o[name + " dcp resume"] == 0.0, (name, o)
        assert o["divide factor 1"] == 0.0, o["divide factor 1"]
        assert o["no reshard"] == 0.0, o["no reshard"]
        assert "the ranks disagree on compression parameters" in o["mismatch"], o["mismatch"]
        errors.add(("mismatch", o["mismatch"]))
        assert o["nan"] and o["nan"].startswith("gradpack.Error") and "NaN" in o["nan"], o["nan"]
        errors.add(o["nan"])
        assert o["nan unchanged"] is True
        assert o["nan first layer before"] == 0.0 and o["nan first layer then"] == 0.0, o
        assert "rank %d's gradient of key 'conv.weight'" % (len(reports) - 1) in o["nan first layer"], o["nan first layer"]
        assert o["nan first layer unchanged"] and o["nan first layer shard"], o
        errors.add(o["nan first layer"])
        assert "the ranks disagree on" in o["divide factor one rank"] and "divide factor" in o["divide factor one rank"], o
        errors.add(o["divide factor one rank"])
        assert o["frozen"] == 0.0, o["frozen"]
        assert o["grad dtypes"] == {"a": [1.0], "b": [2.0], "c": [3.0]}, o["grad dtypes"]
        assert "rank 1's key" in o["dtype one rank"] and "its dtype is not one gradpack compresses" in o["dtype one rank"], o
        errors.add(o["dtype one rank"].split(" (on this rank:")[0])
        assert "holds no fully_shard module" in o["not fsdp"], o["not fsdp"]
        assert o["load other"].startswith("gradpack.Error"), o["load other"]
        assert "not a gradpack.torch.fsdp state_dict" in o["load ddp"], o["load ddp"]
        assert "was saved by %d ranks; this job runs %d" % (len(reports) + 1, len(reports)) in o["load other world"], o
        errors.add(o["load other world"])
    # The NaN's, the mismatch's, the divide factor's, the first layer's NaN,
    # the refused dtype and the checkpoint of another world, each the same on both ranks.
    assert len(errors) == 6, errors


@pytest.mark.parametrize("world", [2, 4])
def test_every_scheme_trains_within_two_points_of_uncompressed_under_fsdp2(world):
    out = torchrun(world, "benches/torch_convergence.py", ["--check", "2.0", "--seeds", "3", "--fsdp"], timeout=1800)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    rows = [l for l in out.stdout.splitlines() if "%" in l]
    assert len(rows) == len(SCHEMES) and "FSDP2" in out.stdout, out.stdout


def test_hsdp_compresses_the_all_reduce_across_replicas(tmp_path):
    """4 ranks as 2 replicas x 2 shards (FSDP2 over the shard dimension,
    gradpack across replicas through FSDP2's all-reduce hook)."""
    reports = ranks(4, ["hsdp"], tmp_path, timeout=600, script="torch_fsdp.py")
    errors = {}
    for rep in reports:
        h = rep["hsdp"]
        for name in SCHEMES + ["2bit shards too", "qsgd_mn shards too"]:
            s = h[name]
            assert s["identical"], (name, s)
            # The same reduce-scatter, then allreduce_ over the replicas under the block's key.
            assert s["max_diff_vs_allreduce"] == 0.0, (name, s)
            st = s["stats"]
            assert st["replicas"]["steps"] == 9, (name, st)
            assert st["exchange"] == ("scatter" if name.endswith("shards too") else "fsdp"), (name, st)
            assert (st["steps"] == 9) == name.endswith("shards too"), (name, st)
            # (PowerSGD sends a unit whose blocks are too small for rank 2, conv's, plainly.)
            if name.split()[0] not in ("none", "powersgd"):
                assert st["replicas"]["compressed_steps"] == 9, (name, st)
        assert h["resume"] == 0.0, h["resume"]
        assert "saved without replicas (HSDP); this state runs with them" in h["load flat"], h["load flat"]
        assert h["nan"].startswith("gradpack.Error") and "non-finite" in h["nan"], h["nan"]
        assert h["nan unchanged"] is True
        assert "native HSDP all-reduces across replicas itself" in h["native"], h["native"]
        assert "replicate_group holds ranks" in h["same group"], h["same group"]
        # Replicas of a shard (ranks j and j + 2) raise the same error.
        errors.setdefault(rep["rank"] % 2, set()).add(h["nan"])
    assert all(len(e) == 1 for e in errors.values()), errors
