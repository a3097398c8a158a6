"""dgtest, the test accelerator (distgrad/testing/accel): the device, the same-device
rule, autograd and an optimizer on it, streams/events/Future(devices=), and the
stream-order checker that turns a missing synchronization into an error.

Every check runs in a spawned worker process, never in pytest's own: loading dgtest
makes it the process's accelerator and must precede the process's first backward
(torch's engine sizes its device threads once), which other test files would break
or be affected by. One worker serves the module; its first start builds the
extension when the cache has none (20-40 s).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import time

import pytest

pytestmark = pytest.mark.timeout(400)

_CTX = mp.get_context("spawn")
SLOW = float(os.environ.get("DISTGRAD_TEST_SLOWDOWN", "3"))
CALL_TIMEOUT = 60 * SLOW


# ---------------------------------------------------------------- the worker

def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("DISTGRAD_TEST_DEVICE", None)
    os.environ.pop("DISTGRAD_TEST_DEVICES", None)
    import torch
    torch.set_num_threads(1)
    from distgrad.testing import accel
    accel.available()   # build (first time) and load; WHY_NOT says why not


def _ready() -> tuple[bool, str | None, float]:
    from distgrad.testing import accel
    t = time.perf_counter()
    ok = accel.available()
    return ok, accel.WHY_NOT or accel.AUTOGRAD_WHY_NOT, time.perf_counter() - t


class _Worker:
    def __init__(self) -> None:
        self.pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=_CTX, initializer=_init_worker)

    def run(self, fn, *args, timeout: float = CALL_TIMEOUT):
        fut = self.pool.submit(fn, *args)
        try:
            return fut.result(timeout=timeout)
        except (cf.TimeoutError, cf.process.BrokenProcessPool):   # hung or crashed: a fresh one
            self.close()
            self.__init__()
            raise

    def close(self) -> None:
        procs = list(getattr(self.pool, "_processes", {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.kill()
            p.join(10)


@pytest.fixture(scope="module")
def dev():
    w = _Worker()
    try:
        ok, why, _ = w.run(_ready, timeout=300 * SLOW)   # the first build happens here
        if not ok:
            pytest.skip(f"dgtest cannot be built here: {why}")
        assert why is None, why
        yield w
    finally:
        w.close()


# ---------------------------------------------------------------- device basics

def _ops_views_copies() -> None:
    import io

    import torch

    from distgrad.testing import accel
    assert accel.device_under_test() == ("cuda" if torch.cuda.is_available() else "dgtest")
    assert torch.dgtest.device_count() == 2 and torch.accelerator.device_count() == 2
    assert torch.accelerator.current_accelerator() == torch.device("dgtest")
    D = "dgtest:1"
    torch.manual_seed(0)
    c = torch.randn(4, 5)
    d = c.to(D)
    assert d.is_dgtest and d.device == torch.device(D)
    assert c.dgtest().device == torch.device("dgtest:0") and c.dgtest(1).device == torch.device(D)
    assert next(torch.nn.Linear(2, 2).dgtest(1).parameters()).device == torch.device(D)

    def same(a, b):
        assert a.device.type == "dgtest", a.device
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)

    # arithmetic, reductions, matmul, tuple and list results
    same(d * 2 + 1, c * 2 + 1)
    same(d.sum(1), c.sum(1))
    same(d @ d.t(), c @ c.t())
    same(d.max(dim=1).values, c.max(dim=1).values)
    same(d.max(dim=1).indices, c.max(dim=1).indices)
    for a, b in zip(d.split(2), c.split(2)):
        same(a, b)
    same(torch.cat([d, d]), torch.cat([c, c]))
    same(d[d > 0], c[c > 0])
    same(d[torch.tensor([0, 2], device=D)], c[torch.tensor([0, 2])])
    same(d.nonzero(), c.nonzero())
    assert d[0, 0].item() == c[0, 0].item()

    # views alias the device storage
    base = d.untyped_storage().data_ptr()
    for v in (d[1:], d.t(), d.view(20), d.expand(2, 4, 5), d.narrow(1, 1, 2), d.unfold(1, 2, 1),
              d.diagonal(), d[:, 2]):
        assert v.device == d.device and v.untyped_storage().data_ptr() == base
    e, f = d.clone(), c.clone()
    e[1:].mul_(3)
    f[1:].mul_(3)
    e.t()[0].zero_()
    f.t()[0].zero_()
    e.view(20)[-1] = 7.0
    f.view(20)[-1] = 7.0
    e.diagonal().add_(1)
    f.diagonal().add_(1)
    same(e, f)

    # in-place and out= write into the tensor's own memory
    ptr = e.data_ptr()
    e.add_(d).clamp_(-1, 1)
    f.add_(c).clamp_(-1, 1)
    assert e.data_ptr() == ptr
    same(e, f)
    out = torch.empty(4, 5, device=D)
    ptr = out.data_ptr()
    torch.mul(d, 2, out=out)
    assert out.data_ptr() == ptr
    same(out, c * 2)
    grown = torch.empty(0, device=D)
    torch.matmul(d, d.t(), out=grown)      # out= that must resize
    same(grown, c @ c.t())
    xs = [d.clone(), d.clone()]
    torch._foreach_add_(xs, [d, d], alpha=2)
    same(xs[1], c * 3)
    r = d.clone()
    r.resize_(30)
    assert r.shape == (30,)
    same(r[:20], c.reshape(20))
    r.fill_(2).zero_()
    same(r, torch.zeros(30))

    # copies in every direction (non_blocking accepted), dtype conversions
    same(d.to("dgtest:0"), c)
    same(d.to("dgtest:0").to(D), c)
    x0 = torch.empty(4, 5, device="dgtest:0")
    x0.copy_(d, non_blocking=True)
    same(x0, c)
    h = torch.empty(4, 5)
    h.copy_(d, non_blocking=True)
    torch.dgtest.synchronize("all")
    assert torch.equal(h, c)
    y = torch.empty(4, 5, device=D, dtype=torch.float64)
    y.copy_(c, non_blocking=True)
    same(y, c.double())
    same(d.to(torch.int32), c.to(torch.int32))
    cc = torch.randn(3, 2, dtype=torch.complex64)
    dc = cc.to(D)
    same(dc.conj().resolve_conj(), cc.conj())
    same(torch.view_as_real(dc), torch.view_as_real(cc))
    assert torch.ones(2, device="dgtest").device == torch.device("dgtest:0")

    # storage, serialization, pinned memory
    buf = io.BytesIO()
    torch.save({"t": d}, buf)
    buf.seek(0)
    back = torch.load(buf)["t"]
    assert back.device == d.device
    same(back, c)
    assert torch.ones(3).pin_memory().is_pinned()
    st = torch.UntypedStorage(16, device=D)
    st.resize_(64)
    assert st.size() == 64 and st.device == torch.device(D)
    assert accel.violations() == []


def test_the_device_runs_ops_aliases_views_and_copies_in_every_direction(dev):
    dev.run(_ops_views_copies)


def _same_device_rule() -> None:
    import torch
    a = torch.ones(3, device="dgtest:0")
    b = torch.ones(3, device="dgtest:1")
    msg = ("Expected all tensors to be on the same device, but found at least two devices, "
           "dgtest:0 and dgtest:1!")
    for bad in (lambda: a + b, lambda: torch.cat([a, b]), lambda: a.add_(b), lambda: a @ b,
                lambda: torch.add(a, a, out=b)):
        try:
            bad()
        except RuntimeError as exc:
            assert str(exc).startswith(msg), str(exc)
        else:
            raise AssertionError("no error")
    try:
        a + torch.ones(3)
    except RuntimeError as exc:
        assert "found at least two devices, dgtest:0 and cpu!" in str(exc), str(exc)
    else:
        raise AssertionError("no error")
    # CPU scalars and 0-dim CPU tensors are allowed, as on CUDA
    assert (a + torch.tensor(2.0)).cpu().tolist() == [3.0] * 3
    assert (a * 2).cpu().tolist() == [2.0] * 3
    assert torch.where(a > 0, a, torch.tensor(0.0)).device == a.device


def test_ops_refuse_tensors_of_two_devices_as_cuda_does(dev):
    dev.run(_same_device_rule)


# ---------------------------------------------------------------- autograd

def _autograd_linear_sgd() -> None:
    import copy

    import torch
    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    gpu = copy.deepcopy(cpu).to("dgtest:1")
    oc = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    og = torch.optim.SGD(gpu.parameters(), lr=0.1, momentum=0.9)
    x, t = torch.randn(32, 8), torch.randint(0, 3, (32,))
    for _ in range(3):
        for m, o, xx, tt in ((cpu, oc, x, t), (gpu, og, x.to("dgtest:1"), t.to("dgtest:1"))):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(xx), tt).backward()
            o.step()
    for a, b in zip(cpu.parameters(), gpu.parameters()):
        assert b.device == torch.device("dgtest:1") and b.grad.device == b.device
        torch.testing.assert_close(a, b.cpu())
        torch.testing.assert_close(a.grad, b.grad.cpu())

    # modules whose ops pick a backend by device: convolution, the fused RNN cells
    for make in (lambda: torch.nn.Conv2d(2, 3, 3), lambda: torch.nn.LSTM(3, 4, num_layers=2),
                 lambda: torch.nn.GRU(3, 4, bias=False)):
        m = make()
        md = copy.deepcopy(m).to("dgtest:0")
        xin = torch.randn(1, 2, 5, 5) if isinstance(m, torch.nn.Conv2d) else torch.randn(5, 2, 3)
        xd = xin.to("dgtest:0").requires_grad_()
        xin.requires_grad_()
        out, outd = m(xin), md(xd)
        if isinstance(out, tuple):
            out, outd = out[0], outd[0]
        torch.testing.assert_close(out, outd.cpu())
        (out * out).sum().backward()
        (outd * outd).sum().backward()
        torch.testing.assert_close(xin.grad, xd.grad.cpu())
        for a, b in zip(m.parameters(), md.parameters()):
            torch.testing.assert_close(a.grad, b.grad.cpu())

    # torch.autograd.grad, double backward, a leaf's .grad accumulating
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    wd = w.detach().to("dgtest:0").requires_grad_()
    g1, = torch.autograd.grad((w.sin() * w).sum(), w, create_graph=True)
    g2, = torch.autograd.grad((wd.sin() * wd).sum(), wd, create_graph=True)
    assert g2.device == wd.device
    torch.testing.assert_close(g1, g2.cpu())
    h1, = torch.autograd.grad(g1.sum(), w)
    h2, = torch.autograd.grad(g2.sum(), wd)
    torch.testing.assert_close(h1, h2.cpu())
    (wd * 2).sum().backward()
    (wd * 3).sum().backward()
    torch.testing.assert_close(wd.grad.cpu(), torch.full((5,), 5.0, dtype=torch.float64))

    # a graph across the two devices
    a = torch.randn(3, device="dgtest:0", requires_grad=True)
    b = (a * 2).to("dgtest:1")
    (b * b).sum().backward()
    assert a.grad.device == a.device
    torch.testing.assert_close(a.grad.cpu(), 8 * a.detach().cpu())


def test_autograd_linear_sgd_conv_rnn_on_the_device_equal_the_cpu(dev):
    dev.run(_autograd_linear_sgd)


# ---------------------------------------------------------------- streams, events, futures

def _streams_events_future() -> None:
    import torch
    D = "dgtest:0"
    s1, s2 = torch.Stream(device=D), torch.dgtest.Stream(0)
    assert s1 != s2 and s1.device == torch.device(D)
    cur = torch.dgtest.current_stream(0)
    assert cur == torch.dgtest.default_stream(0) and cur.stream_id == 0
    with torch.dgtest.stream(s1):
        assert torch.dgtest.current_stream(0) == s1
        assert torch.accelerator.current_stream(0) == s1
    with s2:   # torch.Stream's own context (torch.accelerator)
        assert torch.accelerator.current_stream() == s2
    assert torch.dgtest.current_stream(0) == cur

    e1, e2 = torch.Event(device=D, enable_timing=True), torch.Event(device=D, enable_timing=True)
    e1.record(s1)
    with torch.dgtest.stream(s1):
        x = torch.arange(4.0, device=D) * 2
    e2.record(s1)
    assert e1.query() and e2.query()
    e2.synchronize()
    assert e1.elapsed_time(e2) >= 0
    cur.wait_event(e2)
    assert x.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
    s1.synchronize()
    assert s1.query()

    # a Future with devices records events on its value's streams; then() runs the
    # callback on pool streams that wait for them; wait() makes the caller's wait
    fut = torch.futures.Future(devices=[D])
    doubled = fut.then(lambda f: f.value() * 2)
    with torch.dgtest.stream(s2):
        v = torch.arange(3.0, device=D) + 1
        fut.set_result(v)
    assert doubled.wait().cpu().tolist() == [2.0, 4.0, 6.0]
    assert fut.wait().cpu().tolist() == [1.0, 2.0, 3.0]
    bad = torch.futures.Future(devices=[D])
    bad.set_result(torch.ones(1, device="dgtest:1"))   # a device the future does not have
    try:
        bad.wait()
    except (RuntimeError, ValueError) as exc:
        assert "dgtest:1" in str(exc), str(exc)
    else:
        raise AssertionError("no error")

    from distgrad.testing import accel
    assert accel.violations() == []


def test_streams_events_and_future_with_devices(dev):
    dev.run(_streams_events_future)


# ---------------------------------------------------------------- the stream-order checker

def _checker_cross_stream_reads() -> None:
    import torch

    from distgrad.testing import accel
    assert accel.checker_enabled()
    D = "dgtest:0"
    producer, consumer = torch.dgtest.Stream(0), torch.dgtest.Stream(0)
    main = torch.dgtest.current_stream(0)

    # no synchronization: the consumer's read raises at once
    with torch.dgtest.stream(producer):
        x = torch.full((4,), 3.0, device=D)
    try:
        with torch.dgtest.stream(consumer):
            x + 1
    except RuntimeError as exc:
        text = str(exc)
    else:
        raise AssertionError("no stream-order violation")
    assert text.startswith("stream-order violation:"), text
    for part in ("aten::add", "dgtest:0", f"stream {producer.stream_id}", f"stream {consumer.stream_id}",
                 "t=", "aten::fill_"):
        assert part in text, (part, text)

    # an event recorded after the write and waited on by the consumer: fine
    with torch.dgtest.stream(producer):
        x = torch.full((4,), 3.0, device=D)
        done = torch.Event(device=D)
        done.record()
    consumer.wait_event(done)
    with torch.dgtest.stream(consumer):
        y = x + 1
    main.wait_stream(consumer)                  # before the host reads y
    assert y.cpu().tolist() == [4.0] * 4

    # wait_stream instead of an event: fine
    with torch.dgtest.stream(producer):
        x.mul_(2)
    consumer.wait_stream(producer)
    with torch.dgtest.stream(consumer):
        y = x + 1
    main.wait_stream(consumer)
    assert y.cpu().tolist() == [7.0] * 4

    # the host reads what a side stream wrote: after synchronize fine, before it not
    with torch.dgtest.stream(producer):
        z = torch.full((2,), 5.0, device=D)
    with accel.expect_violation("reads"):
        z.cpu()
    torch.dgtest.synchronize()
    assert z.cpu().tolist() == [5.0, 5.0] and z.sum().item() == 10.0

    # write after read: another stream overwrites what a stream still reads
    with torch.dgtest.stream(consumer):
        z * 2
    with accel.expect_violation("write after read"):
        z.fill_(0)
    main.wait_stream(consumer)
    z.fill_(0)
    torch.dgtest.synchronize()
    accel.clear_violations()


def test_checker_raises_on_a_read_without_synchronization_and_passes_with_it(dev):
    dev.run(_checker_cross_stream_reads)


def _checker_frees() -> None:
    import torch

    from distgrad.testing import accel
    D = "dgtest:0"
    side = torch.dgtest.Stream(0)
    main = torch.dgtest.current_stream(0)

    # used on a side stream, freed (on the main stream) without record_stream
    x = torch.ones(8, device=D)
    side.wait_stream(main)
    with torch.dgtest.stream(side):
        y = x * 2
    with accel.expect_violation("freed while stream") as caught:
        del x
    assert "call record_stream" in caught.message and "dgtest:0" in caught.message, caught.message
    # the deleter cannot raise: without expect_violation the next op raises
    x = torch.ones(8, device=D)
    side.wait_stream(main)
    with torch.dgtest.stream(side):
        y = x * 2
    del x
    try:
        torch.ones(1, device=D)
    except RuntimeError as exc:
        assert str(exc).startswith("stream-order violation:") and "freed while" in str(exc)
    else:
        raise AssertionError("no stream-order violation")

    # with record_stream, or once the main stream waited for the side stream: fine
    x = torch.ones(8, device=D)
    side.wait_stream(main)
    with torch.dgtest.stream(side):
        y = x * 2
        x.record_stream(side)
    del x
    x = torch.ones(8, device=D)
    side.wait_stream(main)
    with torch.dgtest.stream(side):
        y = x * 2
    main.wait_stream(side)
    del x
    accel.check()
    torch.dgtest.synchronize()
    del y

    # the checker off: nothing raises, and nothing stays in the log
    accel.clear_violations()
    accel.set_checker(False)
    with torch.dgtest.stream(side):
        w = torch.ones(2, device=D)
    w + 1
    accel.set_checker(True)
    w + 1                    # what happened while off is forgotten
    torch.dgtest.synchronize()
    del w
    assert accel.violations() == []
    # log-only mode: recorded, not raised
    accel.set_checker(True, raise_errors=False)
    with torch.dgtest.stream(side):
        w2 = torch.ones(2, device=D)
    w2 + 1
    assert len(accel.violations()) == 1 and "stream-order violation:" in accel.violations()[0]
    with accel.expect_violation("reads"):
        w2 + 2
    accel.set_checker(True)
    torch.dgtest.synchronize()
    del w2
    accel.check()
    accel.clear_violations()


def test_checker_raises_on_a_free_racing_a_stream_unless_record_stream(dev):
    dev.run(_checker_frees)


def _staged_bytes_land_after_a_host_synchronization() -> None:
    import torch
    D = "dgtest:0"
    side = torch.dgtest.Stream(0)
    x = torch.arange(6, dtype=torch.float32, device=D) + 1
    n = torch.arange(4, device=D) * 3
    side.wait_stream(torch.dgtest.current_stream(0))
    host = torch.empty(6, pin_memory=True)
    ints = torch.empty(4, dtype=torch.int64, pin_memory=True)
    with torch.dgtest.stream(side):
        host.copy_(x, non_blocking=True)        # in flight until the host waits for `side`
        ints.copy_(n, non_blocking=True)
        ev = side.record_event()
    assert torch.isnan(host).all() and (ints == 91).all()   # read too early: not the bytes
    back = torch.empty(6, device=D)
    with torch.dgtest.stream(side):             # the same stream reads the buffer: in order
        back.copy_(host, non_blocking=True)
    torch.dgtest.current_stream(0).wait_stream(side)
    assert back.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    ev.synchronize()                             # the host waits for the event: landed
    assert host.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and ints.tolist() == [0, 3, 6, 9]
    pageable = torch.empty(6)                    # not pinned: a blocking copy, as on CUDA
    with torch.dgtest.stream(side):
        pageable.copy_(x * 2, non_blocking=True)
    assert pageable.tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
    torch.dgtest.synchronize()


def test_staged_bytes_land_only_after_a_host_synchronization(dev):
    """A non-blocking copy into pinned host memory is in flight until the host waits for
    its stream (an event, the stream or the device), as on a GPU: before that the buffer
    holds a poison (NaN, 91), so code that reads staged bytes without waiting computes a
    wrong number; a copy back on the same stream reads them in order."""
    dev.run(_staged_bytes_land_after_a_host_synchronization)


# ---------------------------------------------------------------- processes

def _child(q, devices: str | None) -> None:
    try:
        if devices:
            os.environ["DISTGRAD_TEST_DEVICES"] = devices
        os.environ.pop("DISTGRAD_TEST_DEVICE", None)
        import torch

        from distgrad.testing import accel
        cached = accel.built()
        t = time.perf_counter()
        name = accel.load()
        took = time.perf_counter() - t
        x = torch.arange(6.0, device="dgtest:1").view(2, 3)
        w = torch.ones(3, device="dgtest:1", requires_grad=True)
        (x @ w).sum().backward()
        q.put((cached, took, name, accel.device_under_test(), torch.dgtest.device_count(),
               w.grad.cpu().tolist(), x.t().sum().item()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        q.put(repr(exc))


def test_spawned_processes_each_load_the_cached_build(dev):
    q = _CTX.Queue()
    procs = [_CTX.Process(target=_child, args=(q, n)) for n in (None, "3")]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=120 * SLOW) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert all(isinstance(g, tuple) for g in got), got
    counts = sorted(g[4] for g in got)
    assert counts == [2, 3]
    for cached, took, name, under_test, _, grad, total in got:
        assert cached, "the build was not in the cache"
        assert name == "dgtest" and under_test in ("dgtest", "cuda")
        assert grad == [3.0, 5.0, 7.0] and total == 15.0
        assert took < 5 * SLOW, f"a cached load took {took:.2f} s"
    print("cached loads took", [round(g[1], 3) for g in got], "s")
