"""A rank of test_torch.py, started as torchrun starts one (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): gradpack.torch's DDP hook on gloo, every
scheme, against allreduce_ on the same gradients and against an
in-process 'device' store with one device per rank. Runs the scenarios
named in argv and writes rank<r>.json with what it saw."""
import copy
import gc
import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from torch_common import SCHEMES, error_of, write_report
import gradpack.kv as kv
import gradpack.torch as gpt

BUCKET_MB = 0.002  # a few KB: several buckets for this model

dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("GRADPACK_TEST_TIMEOUT", "60"))))
RANK, WORLD = dist.get_rank(), dist.get_world_size()


class Net(torch.nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 6 * 6, 32)
        self.fc2 = torch.nn.Linear(32, 10)
        self.unused = torch.nn.Linear(5, 5) if unused else None

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 1, 8, 8, generator=g).to(dtype), torch.randint(0, 10, (16,), generator=g)


def loss_of(model, step, rank, dtype=torch.float32):
    x, y = batch(step, rank, dtype)
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def flat_grads(model):
    return torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters() if p.grad is not None])


def identical_everywhere(t):
    everyone = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], x) for x in everyone)


def make(params, dtype=torch.float32, unused=False, state_kw=None, **ddp_kw):
    torch.manual_seed(0)
    model = Net(unused).to(dtype)
    ref = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB, **ddp_kw)
    state = gpt.State(params, **dict({"min_compression_rate": 0}, **(state_kw or {})))
    ddp.register_comm_hook(state, gpt.hook)
    return model, ref, ddp, state


def hook_against_allreduce(params, steps=3, dtype=torch.float32, accumulate=1, unused=False, state_kw=None, **ddp_kw):
    """Trains `steps` steps through the hook and, on a copy of the model fed
    the same data, through allreduce_ parameter by parameter (the keys the
    hook gave them): the gradients must be the same bits. Returns facts and
    every step's local gradients (for the device store)."""
    model, ref, ddp, state = make(params, dtype, unused, state_kw, **ddp_kw)
    mirror = gpt.State(params, **dict({"min_compression_rate": 0}, **(state_kw or {})))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    worst, identical, local, results = 0.0, True, [], []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(accumulate):
            if micro < accumulate - 1:
                with ddp.no_sync():
                    loss_of(ddp, step * accumulate + micro, RANK, dtype).backward()
            else:
                loss_of(ddp, step * accumulate + micro, RANK, dtype).backward()
            loss_of(ref, step * accumulate + micro, RANK, dtype).backward()
        mine = {}
        for p, q in zip(model.parameters(), ref.parameters()):
            if p.grad is None:
                continue
            key = state._param_keys[id(p)]
            mine[key] = q.grad.detach().float().clone()
            gpt.allreduce_(q.grad, mirror, key=key)
            worst = max(worst, float((p.grad.float() - q.grad.float()).abs().max()))
        local.append(mine)
        results.append({state._param_keys[id(p)]: p.grad.detach().float().numpy().tolist() for p in model.parameters() if p.grad is not None})
        identical = identical and identical_everywhere(flat_grads(model))
        opt.step()
        ref_opt.step()
    stats = state.stats()
    del ddp
    return {"max_diff_vs_allreduce": worst, "replicas_identical": identical, "stats": stats}, local, results


def device_store_matches(params, local, results):
    """Rank 0: an in-process 'device' store with one device per rank, pushed
    every rank's local gradients, key by key and step by step: its sum over
    the world size against what the hook gave (largest difference)."""
    # Tensor collectives only: torch 2.15's object collectives on gloo can
    # abort the process at exit.
    everyone = [[{} for _ in local] for _ in range(WORLD)]
    for step, mine in enumerate(local):
        for key, value in mine.items():
            parts = [torch.empty_like(value) for _ in range(WORLD)]
            dist.all_gather(parts, value)
            for r in range(WORLD):
                everyone[r][step][key] = parts[r].numpy()
    if RANK != 0:
        return None
    store = kv.create("device")
    if params["compress"] != "none":
        store.set_compress(params)
    worst = 0.0
    for step, got in enumerate(results):
        for key, value in got.items():
            grads = [everyone[r][step][key] for r in range(WORLD)]
            if step == 0:
                store.init(key, np.zeros_like(grads[0]))
            store.push(key, grads)
            out = np.zeros_like(grads[0])
            store.pull(key, out=out)
            want = out / np.float32(WORLD)
            worst = max(worst, float(np.abs(np.array(value, np.float32) - want).max()))
    return worst


def scenario_schemes():
    out = {}
    for params in SCHEMES:
        facts, local, results = hook_against_allreduce(params)
        facts["device_store_max_diff"] = device_store_matches(params, local, results)
        out[params["compress"]] = facts
    return out


def scenario_ddp_options():
    """Bucket layouts and DDP's options, for a scheme with a residual and
    one with random choices."""
    out = {}
    for params in (SCHEMES[1], SCHEMES[5], SCHEMES[7]):
        name = params["compress"]
        out[name + " no_sync"] = hook_against_allreduce(params, accumulate=2)[0]
        out[name + " find_unused"] = hook_against_allreduce(params, unused=True, find_unused_parameters=True)[0]
        out[name + " static_graph"] = hook_against_allreduce(params, static_graph=True)[0]
        out[name + " bucket_view"] = hook_against_allreduce(params, gradient_as_bucket_view=True)[0]
        out[name + " one bucket"] = hook_one_bucket(params)
        for dtype in (torch.float16, torch.bfloat16):
            out["%s %s" % (name, dtype)] = hook_against_allreduce(params, dtype=dtype)[0]
    return out


def hook_one_bucket(params):
    global BUCKET_MB
    saved, BUCKET_MB = BUCKET_MB, 25
    try:
        return hook_against_allreduce(params)[0]
    finally:
        BUCKET_MB = saved


def scenario_start_and_rate():
    params = SCHEMES[2]
    out = {}
    # start_iter: plain sums for the first 2 steps: exactly gloo's float32 sum / world.
    model, ref, ddp, state = make(params, state_kw={"start_iter": 2})
    plain_diff = 0.0
    for step in range(4):
        ddp.zero_grad()
        ref.zero_grad()
        loss_of(ddp, step, RANK).backward()
        loss_of(ref, step, RANK).backward()
        if step < 2:
            want = flat_grads(ref)
            dist.all_reduce(want)
            plain_diff = max(plain_diff, float((flat_grads(model) - want / WORLD).abs().max()))
    out["start_iter"] = {"plain_diff": plain_diff, "stats": state.stats()}
    del ddp
    # min_compression_rate: nothing shrinks a billion times.
    model, ref, ddp, state = make(params, state_kw={"min_compression_rate": 1e9})
    for step in range(2):
        ddp.zero_grad()
        loss_of(ddp, step, RANK).backward()
    out["min_rate_huge"] = state.stats()
    del ddp
    # The default rate (2): the conv bias (4 values) goes plain, the rest compressed.
    facts = hook_against_allreduce(params, state_kw={"min_compression_rate": 2.0})[0]
    out["min_rate_default"] = facts
    return out


def train(params, steps, state_dict=None, stop_at=None, state_kw=None):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    state = gpt.State(params, **dict({"min_compression_rate": 0}, **(state_kw or {})))
    ddp.register_comm_hook(state, gpt.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = 0
    if state_dict is not None:
        model.load_state_dict(state_dict["model"])
        opt.load_state_dict(state_dict["opt"])
        state.load_state_dict(state_dict["gradpack"])
        first = state_dict["step"]
    saved = None
    for step in range(first, steps):
        if step == stop_at:
            saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                     "gradpack": state.state_dict(), "step": step}
        opt.zero_grad()
        loss_of(ddp, step, RANK).backward()
        opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    del ddp
    return weights, saved


def scenario_resume():
    out = {}
    for params in SCHEMES:
        whole, saved = train(params, 6, stop_at=3)
        resumed, _ = train(params, 6, state_dict=saved)
        out[params["compress"]] = float((whole - resumed).abs().max())
    return out


class Lora(torch.nn.Module):
    """A frozen-shape linear layer with a LoRA adapter: B starts at zero, so
    A's first gradient is exactly zero (PowerSGD's Q for A collapses)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(32, 16, bias=False)
        self.a = torch.nn.Parameter(torch.randn(4, 32) * 0.1)
        self.b = torch.nn.Parameter(torch.zeros(16, 4))

    def forward(self, x):
        return self.w(x) + (x @ self.a.t()) @ self.b.t()


def scenario_powersgd_recovery():
    """LoRA's zero-initialised B (training with SGD), then a 1e10 spike of
    the loss on the last rank (B nonzero, no optimizer steps: error feedback
    pays the spike out over the next steps): A's gradient through the hook
    against plain DDP's, step by step."""
    out = {}
    for case in ("lora", "spike"):
        torch.manual_seed(0)
        model = Lora()
        if case == "spike":
            with torch.no_grad():
                model.b.normal_(0, 0.1)
        plain = copy.deepcopy(model)
        ddp, ref = DDP(model), DDP(plain)
        state = gpt.State({"compress": "powersgd", "rank": 1, "seed": 1}, min_compression_rate=0)
        ddp.register_comm_hook(state, gpt.hook)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
        a_grads, plain_grads, finite, identical = [], [], True, True
        for step in range(6):
            g = torch.Generator().manual_seed(1000 * RANK + step)
            x, y = torch.randn(64, 32, generator=g), torch.randn(64, 16, generator=g)
            for m, o in ((ddp, opt), (ref, ref_opt)):
                o.zero_grad()
                loss = ((m(x) - y) ** 2).mean()
                if case == "spike" and step == 2 and RANK == WORLD - 1 and m is ddp:
                    loss = loss * 1e10
                loss.backward()
            a_grads.append(float(model.a.grad.abs().max()))
            plain_grads.append(float(plain.a.grad.abs().max()))
            finite = finite and all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            identical = identical and identical_everywhere(flat_grads(model))
            if case == "lora":
                opt.step()
                ref_opt.step()
        out[case] = {"a_grad": a_grads, "plain_a_grad": plain_grads, "finite": finite, "replicas_identical": identical}
        del ddp, ref
    # A P sum past float32 (finite gradients of 3e38): the same error on every
    # rank, the state as it was, and the next call works.
    state = gpt.State({"compress": "powersgd", "rank": 1, "seed": 1}, min_compression_rate=0)
    gpt.allreduce_(torch.ones(64, 32), state, key="w")
    before = state.state_dict()["states"]
    out["overflow"] = error_of(lambda: gpt.allreduce_(torch.full((64, 32), 3e38), state, key="w"))
    out["overflow unchanged"] = state.state_dict()["states"] == before
    out["overflow then"] = error_of(lambda: gpt.allreduce_(torch.ones(64, 32), state, key="w"))
    return out


def nan_on_last_rank(params, state_kw=None):
    """Two steps through the hook, the last rank's second loss NaN: the
    error this rank saw, whether its states stayed as they were, and its
    State."""
    model, ref, ddp, state = make(params, state_kw=state_kw)
    ddp.zero_grad()
    loss_of(ddp, 0, RANK).backward()
    before = state.state_dict()["states"]
    ddp.zero_grad()
    loss = loss_of(ddp, 1, RANK)
    if RANK == WORLD - 1:
        loss = loss * float("nan")
    error = error_of(lambda: loss.backward())
    unchanged = state.state_dict()["states"] == before
    del ddp
    dist.barrier()
    return error, unchanged, state


def scenario_faults():
    out = {}
    params = {"compress": "2bit", "threshold": 0.05}
    for scheme in (params, SCHEMES[2], SCHEMES[5], SCHEMES[7]):
        out["nan " + scheme["compress"]], out["nan unchanged " + scheme["compress"]], _ = nan_on_last_rank(scheme)
    # Mismatched compress_params on the last rank.
    other = {"compress": "qsgd_mn", "bits": 4 if RANK == WORLD - 1 else 2}
    model, ref, ddp, state = make(other)
    out["mismatch"] = error_of(lambda: loss_of(ddp, 0, RANK).backward())
    del ddp
    dist.barrier()
    # allreduce_ of another shape under the same key on the last rank.
    state = gpt.State(SCHEMES[2])
    shape = (6, 7) if RANK == WORLD - 1 else (7, 6)
    out["layout"] = error_of(lambda: gpt.allreduce_(torch.ones(shape), state, key="w"))
    # load_state_dict: another compression, world size, shapes.
    state = gpt.State(SCHEMES[2], min_compression_rate=0)
    gpt.allreduce_(torch.ones(3, 4), state, key="w")
    good = state.state_dict()
    other_state = gpt.State(SCHEMES[3], min_compression_rate=0)
    out["load other compression"] = error_of(lambda: other_state.load_state_dict(good))
    fresh = gpt.State(SCHEMES[2], min_compression_rate=0)
    gpt.allreduce_(torch.ones(4, 3), fresh, key="w")
    out["load other shape"] = error_of(lambda: fresh.load_state_dict(good))
    out["load other shape unchanged"] = fresh.state_dict()["states"] != good["states"]
    if WORLD > 2:
        sub = dist.new_group([0, 1])
        if RANK < 2:
            small = gpt.State(SCHEMES[2], process_group=sub, min_compression_rate=0)
            out["load other world"] = error_of(lambda: small.load_state_dict(good))
    out["bad params"] = error_of(lambda: gpt.State({"compress": "qsgd_mn_ts", "bits": 4}))
    out["local unselected"] = error_of(lambda: gpt.State({"compress": "grandk_mn", "bits": 2, "k": 4, "unselected": "local"}))
    out["meta tensor"] = error_of(lambda: gpt.allreduce_(torch.ones(3, device="meta"), state, key="m"))
    # Input refused on the last rank alone: that rank takes its part in the
    # exchange as a refusal, so every rank raises (none waits), a settled
    # job (a plan, no agreement) as a new one; every state unchanged.
    state = gpt.State(SCHEMES[2], min_compression_rate=0)
    good = lambda: torch.full((6, 7), float(RANK))  # noqa: E731
    last = RANK == WORLD - 1
    for what, tensor, key in [("dtype", torch.ones(6, 7, dtype=torch.float64), "w"), ("key", good(), "w\0x"),
                              ("expanded", torch.ones(1, 7).expand(6, 7), "w"), ("dims", torch.ones([1] * 33), "w")]:
        before = state.state_dict()["states"]
        out["refused " + what] = error_of(lambda: gpt.allreduce_(tensor if last else good(), state, key if last else "w"))
        out["refused unchanged " + what] = state.state_dict()["states"] == before
        t = good()
        out["refused then " + what] = error_of(lambda: gpt.allreduce_(t, state, "w"))
        out["refused then identical " + what] = identical_everywhere(t)
    # A State argument refused on the last rank alone: every rank refuses it.
    out["state args"] = error_of(lambda: gpt.State({"compress": "qsgd_mn", "bits": 16 if last else 2}))
    out["state start_iter"] = error_of(lambda: gpt.State(SCHEMES[2], start_iter=-1 if last else 0))
    # A NaN in one parameter of the step's first-encoded bucket's successor:
    # the buckets that decoded before the failure keep their states too.
    for params in (SCHEMES[1], SCHEMES[2], SCHEMES[8]):
        model, ref, ddp, state = make(params)
        for step in range(2):
            ddp.zero_grad()
            loss_of(ddp, step, RANK).backward()
        before = state.state_dict()["states"]
        handle = model.conv.weight.register_hook(lambda g: g * float("nan") if last else g)
        ddp.zero_grad()
        out["nan one param " + params["compress"]] = error_of(lambda: loss_of(ddp, 2, RANK).backward())
        out["nan one param unchanged " + params["compress"]] = state.state_dict()["states"] == before
        handle.remove()
        del ddp
        dist.barrier()
    return out


# Blocking rounds each scheme makes per bucket before its final sums
# (QSGD's shared scale, the two-scale and multi-scale kinds' scale indices,
# PowerSGD's P).
EXCHANGES = {"none": 0, "2bit": 0, "qsgd_mn": 1, "qsgd_mn_ts": 2, "qsgd_mn_ms": 2, "grandk_mn": 1,
             "grandk_mn_ts": 2, "powersgd": 1, "1bit": 0}


def scenario_steady():
    """Every scheme through DDP for 6 steps: the all-reduces each step
    issues (counted by wrapping torch.distributed.all_reduce, which
    gradpack.torch calls), the hook's calls, and the blocking agreement
    rounds run so far (stats), step by step."""
    out = {}
    real = dist.all_reduce
    count = [0]

    def counting(tensor, *a, **kw):
        count[0] += 1
        return real(tensor, *a, **kw)

    for params in SCHEMES:
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
        state = gpt.State(params, min_compression_rate=0)
        calls = [0]

        def hook(state, bucket):
            calls[0] += 1
            return gpt.hook(state, bucket)

        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        facts = {"collectives": [], "hooks": [], "agreements": []}
        for step in range(6):
            count[0] = calls[0] = 0
            opt.zero_grad()
            dist.all_reduce = counting
            try:
                loss_of(ddp, step, RANK).backward()
            finally:
                dist.all_reduce = real
            opt.step()
            facts["collectives"].append(count[0])
            facts["hooks"].append(calls[0])
            facts["agreements"].append(state.stats()["agreements"])
        facts["replicas_identical"] = identical_everywhere(flat_grads(model))
        out[params["compress"]] = facts
        del ddp
        dist.barrier()
    return out


def train_steps(ddp, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(ddp, step, RANK).backward()
        opt.step()


def scenario_departures():
    """Once a job has settled (no agreement rounds any more), a rank that
    departs from what the others run: the same error on every rank,
    every state unchanged, and the job goes on."""
    out = {}
    # allreduce_ of another key and shape on the last rank.
    state = gpt.State(SCHEMES[1], min_compression_rate=0)
    for step in range(4):
        gpt.allreduce_(torch.full((7, 6), float(step + RANK)), state, key="w")
    settled, before = state.stats()["agreements"], state.state_dict()["states"]
    if RANK == WORLD - 1:
        out["other layout"] = error_of(lambda: gpt.allreduce_(torch.ones(3, 3), state, key="v"))
    else:
        out["other layout"] = error_of(lambda: gpt.allreduce_(torch.ones(7, 6), state, key="w"))
    out["other layout unchanged"] = state.state_dict()["states"] == before
    out["other layout agreements"] = state.stats()["agreements"] - settled
    t = torch.full((7, 6), float(RANK))
    out["other layout then"] = error_of(lambda: gpt.allreduce_(t, state, key="w"))
    out["other layout then identical"] = identical_everywhere(t)
    # DDP: a checkpoint loaded on the last rank only, a NaN long after the first step.
    for params in (SCHEMES[1], SCHEMES[2], SCHEMES[3], SCHEMES[7], SCHEMES[8]):
        name = params["compress"]
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
        state = gpt.State(params, min_compression_rate=0)
        ddp.register_comm_hook(state, gpt.hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_steps(ddp, opt, 2)
        older = state.state_dict()
        train_steps(ddp, opt, 4, 2)
        settled, before = state.stats()["agreements"], state.state_dict()["states"]
        if RANK == WORLD - 1:
            state.load_state_dict(older)
        loaded = state.state_dict()["states"]
        opt.zero_grad()
        out["load one " + name] = error_of(lambda: loss_of(ddp, 6, RANK).backward())
        out["load one unchanged " + name] = state.state_dict()["states"] == loaded
        # DDP cannot go on after a hook raised: a new DDP of the same model and State.
        del ddp
        ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
        ddp.register_comm_hook(state, gpt.hook)
        # Every rank loads it: the next step runs (stand-ins, then the real bucket).
        state.load_state_dict(older)
        opt.zero_grad()
        out["load all " + name] = error_of(lambda: loss_of(ddp, 6, RANK).backward())
        out["load all identical " + name] = out["load all " + name] is None and identical_everywhere(flat_grads(model))
        train_steps(ddp, opt, 3, 7)
        settled, before = state.stats()["agreements"], state.state_dict()["states"]
        opt.zero_grad()
        loss = loss_of(ddp, 10, RANK)
        if RANK == WORLD - 1:
            loss = loss * float("nan")
        out["late nan " + name] = error_of(lambda: loss.backward())
        out["late nan unchanged " + name] = state.state_dict()["states"] == before
        out["late nan agreements " + name] = state.stats()["agreements"] - settled
        del ddp
        dist.barrier()
    return out


def scenario_dead_rank():
    """The last rank exits after one step; the others' next step must end
    with torch's own error within the process group's timeout."""
    model, ref, ddp, state = make(SCHEMES[2])
    ddp.zero_grad()
    loss_of(ddp, 0, RANK).backward()
    if RANK == WORLD - 1:
        os._exit(0)
    ddp.zero_grad()
    return {"error": error_of(lambda: loss_of(ddp, 1, RANK).backward())}


LOCAL = 2  # ranks a "node" in the hierarchical scenario (ranks grouped by number)


def by_hand(x, key, state):
    """The hierarchical exchange of `x` written out: rows cut into LOCAL
    blocks (the last padded), the node's float32 reduce-scatter, this
    rank's block of the node's mean through a flat State over the ranks of its local index
    (`state`, key '<key>@<local>/<LOCAL>'), the node's all-gather."""
    node, local = divmod(RANK, LOCAL)
    rows = -(-x.shape[0] // LOCAL)
    padded = torch.cat([x, x.new_zeros((rows * LOCAL - x.shape[0],) + tuple(x.shape[1:]))])
    block = torch.empty((rows,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(block, padded.contiguous(), group=by_hand.intra[node])
    block.div_(LOCAL)  # the node's mean, pushed as one worker's gradient
    gpt.allreduce_(block, state, key="%s@%d/%d" % (key, local, LOCAL))
    dist.all_gather_into_tensor(padded, block, group=by_hand.intra[node])
    return padded[:x.shape[0]]


def scenario_hierarchical():
    """Ranks in nodes of LOCAL (by rank number): allreduce_ against the
    exchange written out by hand, DDP replicas, checkpoint resume, and
    every refusal on every rank."""
    out = {}
    nodes = WORLD // LOCAL
    # Groups made in one order on every rank (new_group is collective).
    by_hand.intra = [dist.new_group(list(range(n * LOCAL, (n + 1) * LOCAL))) for n in range(nodes)]
    inter = [dist.new_group(list(range(j, WORLD, LOCAL))) for j in range(LOCAL)]
    for params in SCHEMES:
        name = params["compress"]
        state = gpt.State(params, min_compression_rate=0, local_size=LOCAL)
        mirror = gpt.State(params, process_group=inter[RANK % LOCAL], min_compression_rate=0)
        worst = 0.0
        for step in range(3):
            g = torch.Generator().manual_seed(100 * RANK + step)
            x = torch.randn(9, 43, generator=g)  # 9 rows: the last block is padded
            got = gpt.allreduce_(x.clone(), state, key="w")
            worst = max(worst, float((got - by_hand(x, "w", mirror)).abs().max()))
        facts = {"max_diff_vs_by_hand": worst, "stats": state.stats()}
        # DDP through the hook: replicas identical, and a resumed run the same bits.
        whole, saved = train(params, 6, stop_at=3, state_kw={"local_size": LOCAL})
        resumed, _ = train(params, 6, state_dict=saved, state_kw={"local_size": LOCAL})
        facts["replicas_identical"] = identical_everywhere(whole)
        facts["resume_diff"] = float((whole - resumed).abs().max())
        out[name] = facts
    # The owners exchange across the nodes: the lanes' bits (up to 8 nodes).
    x = torch.randn(9, 43, generator=torch.Generator().manual_seed(RANK))
    got = {}
    for exchange in ("lanes", "owners"):
        st = gpt.State({"compress": "2bit", "threshold": 0.05}, min_compression_rate=0, local_size=LOCAL, exchange=exchange)
        got[exchange] = gpt.allreduce_(x.clone(), st, key="o")
        out["stats " + exchange] = st.stats()
    out["owners across nodes"] = float((got["lanes"] - got["owners"]).abs().max())
    # A NaN on the last rank at the second step: the same error everywhere, nothing changed.
    out["nan"], out["nan unchanged"], state = nan_on_last_rank({"compress": "2bit", "threshold": 0.05}, {"local_size": LOCAL})
    saved = state.state_dict()
    flat = gpt.State({"compress": "2bit", "threshold": 0.05}, min_compression_rate=0, local_size=1)
    out["load flat"] = error_of(lambda: flat.load_state_dict(saved))
    out["other sizes"] = error_of(lambda: gpt.State(SCHEMES[2], local_size=LOCAL if RANK else WORLD))
    out["not dividing"] = error_of(lambda: gpt.State(SCHEMES[2], local_size=WORLD - 1))
    out["subgroup"] = error_of(lambda: gpt.State(SCHEMES[2], process_group=inter[RANK % LOCAL], local_size=LOCAL))
    # The ranks of a node differ where the exchange across nodes cannot see
    # it (by local rank alike on every node): the node compares its bucket
    # and settings before its reduce-scatter, so every rank fails alike
    # (no silent mix, no reduce-scatter of sizes that differ), and the job goes on.
    odd = RANK % LOCAL == 1
    x = torch.randn(9, 43, generator=torch.Generator().manual_seed(RANK))
    st = gpt.State(SCHEMES[2], min_compression_rate=0, local_size=LOCAL)
    out["key by local"] = error_of(lambda: gpt.allreduce_(x.clone(), st, key="b" if odd else "a"))
    out["shape by local"] = error_of(lambda: gpt.allreduce_(torch.randn(12 if odd else 9, 43), st, key="a"))
    out["then"] = error_of(lambda: gpt.allreduce_(x.clone(), st, key="a"))
    mixed = gpt.State(SCHEMES[1] if odd else SCHEMES[2], min_compression_rate=0, local_size=LOCAL)
    out["settings by local"] = error_of(lambda: gpt.allreduce_(x.clone(), mixed, key="a"))
    late = gpt.State(SCHEMES[2], min_compression_rate=0, local_size=LOCAL, start_iter=5 if odd else 0)
    out["start_iter by local"] = error_of(lambda: gpt.allreduce_(x.clone(), late, key="a"))
    # A tensor refused on the last rank with more dimensions than any bucket holds.
    out["dims one rank"] = error_of(lambda: gpt.allreduce_(torch.ones([1] * 33) if RANK == WORLD - 1 else x.clone(), st, key="a"))
    # A checkpoint of the node's other rank (the blob names only the node).
    peer = dict(st.state_dict(), rank=RANK ^ 1)
    out["load peer"] = error_of(lambda: st.load_state_dict(peer))
    # The node's groups wait as long as the default group does.
    out["timeouts"] = [str(gpt._timeout_of(g)) for g in (st._intra, st._comm, dist.distributed_c10d._get_default_group())]
    return out


INTEGER = [p for p in SCHEMES if p["compress"] not in ("none", "powersgd")]
BIG = 1 << 20  # the values of the tensor whose bytes per step are reported


def scenario_owners():
    """The owners exchange beside lanes at this world size: bytes per step
    of a 1M-value tensor through allreduce_ for every integer scheme, the
    same bits on every rank, 2-bit against its exact sum written here (the
    lanes' bits; the owners' too up to 8 ranks, beyond an unbiased
    neighbour on a grid of 1/8 code step), DDP through the hook
    with a checkpoint resumed, and a NaN on the last rank."""
    out = {}
    for params in INTEGER:
        name = params["compress"]
        if "k" in params:
            params = dict(params, k=BIG // 4)  # a quarter of the values, as the bytes goal has it
        for exchange in ("lanes", "owners"):
            state = gpt.State(params, min_compression_rate=0, exchange=exchange)
            g = torch.Generator().manual_seed(RANK)
            identical = True
            for step in range(3):  # the third is planned: no agreement round
                before = state.stats()["bytes_sent"]
                got = gpt.allreduce_(torch.randn(BIG, generator=g), state, key="w")
                identical = identical and identical_everywhere(got)
            st = state.stats()
            out["%s %s" % (name, exchange)] = {"bytes_per_step": st["bytes_sent"] - before, "identical": identical,
                                               "exchange": st["exchange"]}
    # 2-bit's first push (no residual yet) summed here: every rank's codes.
    th = 0.5
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(7 + RANK))
    xs = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(xs, x)
    xs = torch.stack(xs)
    pos, neg = (xs >= th).sum(0).float(), (xs <= -th).sum(0).float()
    exact = (pos * th + neg * -th) / WORLD
    for exchange in ("lanes", "owners"):
        state = gpt.State({"compress": "2bit", "threshold": th}, min_compression_rate=0, exchange=exchange)
        got = gpt.allreduce_(x.clone(), state, key="r")
        diff = got - exact
        out["2bit reference " + exchange] = {
            "max_diff": float(diff.abs().max()), "moved": int((diff != 0).sum()), "mean_shift": float(diff.sum() / max(1, int((diff != 0).sum()))),
            "identical": identical_everywhere(got)}
    for params in (SCHEMES[1], SCHEMES[3]):
        whole, saved = train(params, 6, stop_at=3, state_kw={"exchange": "owners"})
        resumed, _ = train(params, 6, state_dict=saved, state_kw={"exchange": "owners"})
        out["ddp " + params["compress"]] = {"identical": identical_everywhere(whole),
                                            "resume_diff": float((whole - resumed).abs().max())}
    out["nan"], out["nan unchanged"], _ = nan_on_last_rank({"compress": "2bit", "threshold": 0.05}, {"exchange": "owners"})
    out["powersgd owners"] = error_of(lambda: gpt.State(SCHEMES[7], exchange="owners"))
    out["bad exchange"] = error_of(lambda: gpt.State(SCHEMES[1], exchange="ring"))
    return out


write_report(globals(), RANK, WORLD)
# torch 2.15 on gloo can abort a process at exit ("terminate called without
# an active exception") when one rank tears down while another is still
# busy, with or without a hook: every rank waits for the others first.
gc.collect()
if "dead_rank" in sys.argv:
    os._exit(0)  # its peer is gone: no collective can complete
dist.barrier()
dist.destroy_process_group()
