"""tools/run_torch_examples.py: the variants it makes, its verdicts, and one real run.

The toy program below is written for this test (not one of pytorch/examples'):
a trainer and a parameter server, distributed autograd and DistributedOptimizer,
random data from the seed the runner sets in every process.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("run_torch_examples", ROOT / "tools" / "run_torch_examples.py")
rte = importlib.util.module_from_spec(_spec)
sys.modules["run_torch_examples"] = rte
_spec.loader.exec_module(rte)

TOY = textwrap.dedent('''\
    import os

    import torch
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    import torch.multiprocessing as mp
    import torch.optim as optim
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef


    def make_layer():
        return torch.nn.Linear(4, 2).cuda()


    def forward(rref, x):
        return rref.local_value()(x)


    def params(rref):
        return [RRef(p) for p in rref.local_value().parameters()]


    def run(rank, world_size):
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "29500"
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
        if rank == 0:
            layer = rpc.remote("w1", make_layer)
            opt = DistributedOptimizer(optim.SGD, rpc.rpc_sync("w1", params, args=(layer,)), lr=0.1)
            for step in range(4):
                x, y = torch.randn(8, 4).cuda(), torch.randn(8, 2)
                with dist_autograd.context() as cid:
                    loss = ((rpc.rpc_sync("w1", forward, args=(layer, x)) - y) ** 2).mean()
                    dist_autograd.backward(cid, [loss])
                    opt.step(cid)
                print(f"step {step} loss {loss.item():.6f}")
        rpc.shutdown()


    if __name__ == "__main__":
        mp.spawn(run, args=(2,), nprocs=2, join=True)
    ''')


def toy_program(**kw) -> rte.Program:
    return rte.Program("toy", "toy", "main.py", metrics=[("loss", r"^step \d+ loss " + rte.NUM)],
                       timeout=120, **kw)


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    (tmp_path / "ex" / "toy").mkdir(parents=True)
    (tmp_path / "ex" / "toy" / "main.py").write_text(TOY)
    return tmp_path / "ex"


def test_variants_swap_imports_drop_cuda_move_ports(examples: Path, tmp_path: Path) -> None:
    ports = {"29500": "41234"}
    rte.make_variant(toy_program(), examples, tmp_path / "t", "torch", ports)
    rte.make_variant(toy_program(), examples, tmp_path / "d", "distgrad", ports)
    t = (tmp_path / "t" / "main.py").read_text()
    d = (tmp_path / "d" / "main.py").read_text()
    assert ".cuda" not in t and ".cuda" not in d
    assert '"41234"' in t and '"41234"' in d and "29500" not in t + d
    assert "import torch.distributed.rpc as rpc" in t
    assert "import distgrad.rpc as rpc" in d
    assert "import distgrad.autograd as dist_autograd" in d
    assert "from distgrad.optim import DistributedOptimizer" in d
    assert "from distgrad.rpc import RRef" in d
    assert "torch.distributed" not in d
    # the rest is untouched: the two variants differ in the import lines only
    diff = [(a, b) for a, b in zip(t.splitlines(), d.splitlines()) if a != b]
    assert len(diff) == 4 and all(a.startswith(("import", "from")) for a, _ in diff)


def test_an_edit_that_matches_nothing_is_an_error(examples: Path, tmp_path: Path) -> None:
    prog = toy_program(edits=[("main.py", r"no such line", "x", "an edit for another version")])
    with pytest.raises(ValueError, match="an edit for another version"):
        rte.make_variant(prog, examples, tmp_path / "v", "torch", {})


def outcome(*losses: str, ok: bool = True) -> rte.Outcome:
    return rte.Outcome(ok, 1.0, {"loss": list(losses)}, {})


def test_verdicts() -> None:
    p = toy_program()
    assert rte.same(p, outcome("1.5", "1.2"), outcome("1.5", "1.2")) == "yes (2 values identical)"
    assert rte.same(p, outcome("1.5", "1.2"), outcome("1.5", "1.200001")).startswith("close (first 1/2")
    assert rte.same(p, outcome("1.5", "1.2"), outcome("1.5", "0.9")).startswith("no (first 1/2")
    assert rte.same(p, outcome("1.5"), outcome("1.5", "0.9")).startswith("no (values printed")
    assert rte.same(p, outcome("1.5"), outcome("1.5", ok=False)) == "-"
    assert rte.same(toy_program(exact_prefix=1), outcome("1.5", "1.2"), outcome("1.5", "0.9")) == (
        "yes (1 identical; 1 after those differ, see the note)")
    noisy = rte.Program("toy", "toy", "main.py", metrics=[("loss", "x", 1e-2)])
    assert rte.same(noisy, outcome("1.0", "2.0"), outcome("1.0", "2.01")).startswith(
        "yes (0 identical; 2 within torch's own noise")
    assert rte.same(noisy, outcome("1.0", "2.0"), outcome("1.0", "2.1")).startswith("no (loss: max rel diff")
    assert rte.same(toy_program(compare="none"), outcome("1.5"), outcome("1.4")).startswith("n/a")


def test_toy_program_gives_the_same_losses_on_torch_and_distgrad(examples: Path, tmp_path: Path) -> None:
    prog = toy_program()
    runs = {}
    for impl in ("torch", "distgrad"):
        vdir = tmp_path / impl
        rte.make_variant(prog, examples, vdir, impl, {"29500": str(rte.free_port())})
        rte.write_shims(vdir / "_rte_shims", old_gym=False)
        log = tmp_path / f"{impl}.log"
        runs[impl] = rte.run_variant(prog, vdir, vdir / "_rte_shims", impl, ROOT, seed=7, timeout=120,
                                     log=log)
        assert runs[impl].ok, log.read_text()[-3000:]
        assert len(runs[impl].values["loss"]) == 4
    assert rte.same(prog, runs["torch"], runs["distgrad"]) == "yes (4 values identical)"
    if os.environ.get("RTE_SHOW"):
        print(rte.table([(prog, runs["torch"], runs["distgrad"])]))
