"""Worker of tests/test_two_hosts.py: 4 workers, 2 per network namespace ("host").

    two_hosts.py train ADDR_A ADDR_B     distributed backward and optimizer step
                                         across the hosts, then checks the links,
                                         then rank 0 traces a call to every worker
                                         and prints the clocks' estimated offsets
    two_hosts.py train+lose ADDR_A ADDR_B DIR  the same, then node 1's workers
                                         wait to be killed (DIR/ready<rank> says
                                         when) and node 0's call them and report
                                         the loss (exit code 17)

Ranks come from the launcher's variables (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE);
rank // LOCAL_WORLD_SIZE is the node, ADDR_A / ADDR_B the nodes' addresses.
"""
import json
import os
import sys
import time

import torch

import distgrad.autograd as dist_autograd
import distgrad.rpc as rpc
from distgrad.errors import WorkerLostError
from distgrad.optim import DistributedOptimizer

MODE, ADDRS = sys.argv[1], sys.argv[2:4]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL = int(os.environ["LOCAL_WORLD_SIZE"])
NODE = RANK // LOCAL
BIG = 1 << 17  # float32 elements: 512 KiB, over the shared-memory threshold (256 KiB)

def say(line: str) -> None:
    """One line in one write: the workers of a node share torchrun's stdout pipe,
    and print()'s text and newline can be two writes another worker's line splits."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())

RANK_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK"]


def make_param(seed: int, shape: tuple) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(*shape, requires_grad=True)


def stage_c(w1_rref, z):
    """On worker1 (node 0), called from worker2 (node 1)."""
    return torch.sin(z) * w1_rref.local_value()


def stage_b(w2_rref, w1_rref, h):
    """On worker2 (node 1): crosses back to node 0 and returns there."""
    z = h @ w2_rref.local_value()
    u = rpc.rpc_sync("worker1", stage_c, args=(w1_rref, z))
    return u * z


def grad_of(cid, rref):
    return dist_autograd.get_gradients(cid)[rref.local_value()]


def forward(x, w0, w2, w1, remote_fn, mul_fn):
    h = torch.tanh(x @ w0)
    y = remote_fn(w2, w1, h)
    y2 = mul_fn(y, h.sum())
    return (y2 ** 2).mean() + 0.5 * h.sum()


def train() -> None:
    if RANK != 0:
        return
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    w0 = make_param(10, (4, 5))
    w2 = rpc.remote("worker2", make_param, args=(12, (5, 5)))
    w1 = rpc.remote("worker1", make_param, args=(11, (5,)))
    with dist_autograd.context() as cid:
        loss = forward(x, w0, w2, w1,
                       lambda a, b, h: rpc.rpc_sync("worker2", stage_b, args=(a, b, h)),
                       lambda y, s: rpc.rpc_sync("worker3", torch.mul, args=(y, s)))
        dist_autograd.backward(cid, [loss])
        grads = {"w0": dist_autograd.get_gradients(cid)[w0],
                 "w2": rpc.rpc_sync("worker2", grad_of, args=(cid, w2)),
                 "w1": rpc.rpc_sync("worker1", grad_of, args=(cid, w1))}
        # the same computation in one process, local autograd
        ref = {"w0": w0.detach().clone().requires_grad_(),
               "w2": w2.to_here().detach().clone().requires_grad_(),
               "w1": w1.to_here().detach().clone().requires_grad_()}

        def local_b(a, b, h):
            z = h @ a
            return torch.sin(z) * b * z

        ref_loss = forward(x, ref["w0"], ref["w2"], ref["w1"], local_b, torch.mul)
        torch.testing.assert_close(loss, ref_loss)
        ref_loss.backward()
        for k in grads:
            torch.testing.assert_close(grads[k], ref[k].grad, msg=f"gradient of {k}")
            assert grads[k].abs().sum() > 0, k
        opt = DistributedOptimizer(torch.optim.SGD, [rpc.RRef(w0), w2, w1], lr=0.05)
        opt.step(cid)
    for k, now in (("w0", w0), ("w2", w2.to_here()), ("w1", w1.to_here())):
        torch.testing.assert_close(now.detach(), ref[k].detach() - 0.05 * ref[k].grad,
                                   msg=f"{k} after the optimizer step")
    say(f"GRADS OK loss={loss.item():.6f}")


def check_links() -> None:
    """Large tensors both ways with every peer, then this worker's view of its links:
    Unix socket and shared memory within a namespace, TCP to the other one only."""
    big = torch.ones(BIG)
    for peer in range(WORLD):
        if peer != RANK:
            out = rpc.rpc_sync(f"worker{peer}", torch.add, args=(big, 1))
            assert out.shape == big.shape and float(out[0]) == 2.0
    info = rpc._get_debug_info()
    for peer in range(WORLD):
        if peer == RANK:
            continue
        link = info[f"peer.worker{peer}"]
        if peer // LOCAL == NODE:
            assert link["link"] == "unix" and link["shm"], (peer, link)
            assert link["shm_messages_sent"] >= 1 and link["shm_messages_received"] >= 1, (peer, link)
        else:
            host = link["remote_address"].rpartition(":")[0]
            assert link["link"] == "tcp" and not link["shm"], (peer, link)
            assert link["shm_messages_sent"] == link["shm_messages_received"] == 0, (peer, link)
            assert host == ADDRS[peer // LOCAL], (peer, link)
    say(f"LINKS OK rank={RANK}")


def traced_clocks() -> None:
    """Rank 0 traces one call to every worker (distgrad.trace) and prints the clocks'
    offsets the trace estimated: the namespaces share one kernel clock, so each must
    come out near zero, within its stated error."""
    if RANK != 0:
        return
    import tempfile

    import distgrad
    path = os.path.join(tempfile.mkdtemp(prefix="two-hosts-trace-"), "trace.json")
    with distgrad.trace(path):
        for peer in range(1, WORLD):
            rpc.rpc_sync(f"worker{peer}", torch.add, args=(torch.ones(2), 1))
    with open(path) as f:
        clock = json.load(f)["otherData"]["distgrad"]["clock"]
    say("TRACE CLOCKS " + json.dumps(clock))


def lose(out_dir: str) -> None:
    with open(os.path.join(out_dir, f"ready{RANK}"), "w") as f:
        f.write(str(os.getpid()))
    if NODE == 1:
        time.sleep(120)  # killed by the test
        sys.exit(5)
    target = f"worker{LOCAL + RANK}"
    try:
        rpc.rpc_sync(target, time.sleep, args=(60,))  # the default timeout: 60 s
    except WorkerLostError as e:
        say(f"LOST rank={RANK} worker={e.worker_name} at={time.time():.3f} ({e})")
        rpc.shutdown()
        sys.exit(17)
    say(f"NOT LOST rank={RANK}")
    sys.exit(1)


say("ENV " + json.dumps({k: os.environ.get(k) for k in RANK_VARS}))
rpc.init_rpc(f"worker{RANK}", rank=RANK, world_size=WORLD)  # default heartbeats (4 s)
train()
check_links()
if MODE == "train":
    traced_clocks()
if MODE == "train+lose":
    lose(sys.argv[4])
rpc.shutdown()
