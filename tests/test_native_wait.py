"""Waiting in C with the GIL released (issue 45, item 1): ``distgrad/transport/_waitc.c``
and its Python reference, ``distgrad/transport/waiting.py``.

* both forms give the same answers: readable, timed out, hung up; a signal's handler
  runs during a wait and one that raises ends it at once; ``epoll_wait_spin`` returns
  what ``select.epoll.poll`` does and a one-shot event is handed out once;
* the gate: no spin while the runnable count leaves no free core, nor past the
  host-wide count of spinners; a dead spinner's slot is not counted and is taken
  over; without ``/proc/loadavg`` or the slot file nothing spins;
* the budget: 2 x the average wait + 5 us under the cap, none above it;
* a worker pair with the native wait (and with a budget that does spin) serves calls
  correctly and an idle worker stays under 5 % of a core; ``DISTGRAD_PURE=1`` and
  ``DISTGRAD_NATIVE_WAIT=0`` (the Python forms) serve them too.

distgrad's waiting module is imported inside the tests: the workers import this file
before their environment is set.
"""
import importlib.machinery
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
from mp_utils import SLOW, run_workers

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def w():
    from distgrad.transport import waiting
    yield waiting
    waiting.setup_gate()   # back to the real files after a test that injected its own


def _forms(w):
    forms = [("python", w._py_wait_fd, w._py_epoll_wait_spin)]
    if w._waitc is not None:
        forms.append(("native", w._waitc.wait_fd, w._waitc.epoll_wait_spin))
    return forms


def test_the_native_wait_runs_wherever_it_was_built_from_this_source(w):
    """Where setup.py built _waitc from the current source (as CI's install does), the
    package uses it: a build that silently fell back would hide the fast form."""
    from distgrad import _build
    why = _build.native_why("distgrad.transport._waitc")
    assert w.NATIVE == (why is None and w.NATIVE_WANTED), (why, w.WHY_NOT)
    import distgrad
    assert distgrad.info()["native_wait"] == w.native_state()


@pytest.mark.parametrize("spin_ns", [0, 2_000_000])
def test_both_forms_agree_on_readable_timed_out_and_hung_up(w, spin_ns):
    for name, wait_fd, _ in _forms(w):
        a, b = socket.socketpair()
        try:
            assert wait_fd(b.fileno(), spin_ns, 0) is False, name
            t0 = time.monotonic()
            assert wait_fd(b, spin_ns, 40) is False, name       # an object with fileno()
            assert time.monotonic() - t0 >= 0.035, name        # the whole timeout, spin included
            a.send(b"x")
            assert wait_fd(b.fileno(), spin_ns, 1000) is True, name
            assert wait_fd(b.fileno(), spin_ns, -1) is True, name  # no limit: ready now
            b.recv(1)
            threading.Timer(0.05, a.send, (b"y",)).start()     # lands during the sleep
            t0 = time.monotonic()
            assert wait_fd(b.fileno(), spin_ns, 5000) is True, name
            assert time.monotonic() - t0 < 2 * SLOW, name
            b.recv(1)
            a.close()                                          # hung up: readable (EOF)
            assert wait_fd(b.fileno(), spin_ns, 1000) is True, name
        finally:
            a.close()
            b.close()
    with pytest.raises(ValueError):
        w._py_wait_fd(-1, 0, 0)
    if w._waitc is not None:
        with pytest.raises(ValueError):
            w._waitc.wait_fd(-1, 0, 0)


def _alarm_after(seconds: float, handler) -> None:
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def test_a_signal_handler_runs_during_a_wait_and_one_that_raises_ends_it(w):
    a, b = socket.socketpair()
    old = signal.getsignal(signal.SIGALRM)
    try:
        for name, wait_fd, _ in _forms(w):
            seen: list = []
            _alarm_after(0.05, lambda *_, seen=seen: seen.append(time.monotonic()))
            t0 = time.monotonic()
            assert wait_fd(b.fileno(), 0, 300) is False, name   # the handler ran; the wait went on
            took = time.monotonic() - t0
            assert seen and took >= 0.29, (name, seen, took)

            def interrupt(*_):
                raise KeyboardInterrupt
            _alarm_after(0.05, interrupt)
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                wait_fd(b.fileno(), 1_000_000, 10_000)            # (Ctrl-C in rpc_sync)
            assert time.monotonic() - t0 < 1.0 * SLOW, name
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        a.close()
        b.close()


@pytest.mark.skipif(not hasattr(select, "epoll"), reason="epoll is Linux's")
def test_epoll_forms_return_what_epoll_poll_does_and_a_one_shot_fires_once(w):
    pairs = [socket.socketpair() for _ in range(3)]
    ep = select.epoll()
    try:
        for _, b in pairs:
            ep.register(b.fileno(), select.EPOLLIN | select.EPOLLONESHOT)
        forms = _forms(w)
        for name, _, epoll_wait in forms:
            assert epoll_wait(ep, 1_000_000, 0, 1) == [], name
            with pytest.raises(ValueError, match="maxevents"):
                epoll_wait(ep, 0, 0, 0)
        for a, _ in pairs:
            a.send(b"x")
        # each form hands out the ready one-shot registrations once, in the same shape
        # as select.epoll.poll: a list of (fd, events) with ints
        got = []
        for name, _, epoll_wait in forms * 2:
            events = epoll_wait(ep, 1_000_000, 50, 1)
            assert type(events) is list and len(events) <= 1, (name, events)
            for fd, ev in events:
                assert type(fd) is int and type(ev) is int and ev == select.EPOLLIN, name
            got += events
        got += ep.poll(0.05, 10)
        assert sorted(fd for fd, _ in got) == sorted(b.fileno() for _, b in pairs)
        for name, _, epoll_wait in forms:
            assert epoll_wait(ep.fileno(), 1_000_000, 20, 4) == [], name   # all consumed
        for _, b in pairs:      # re-armed: several at once, with maxevents
            ep.modify(b.fileno(), select.EPOLLIN | select.EPOLLONESHOT)
        name, _, epoll_wait = forms[-1]
        assert sorted(epoll_wait(ep, 0, 100, -1)) == sorted((b.fileno(), select.EPOLLIN)
                                                            for _, b in pairs)
    finally:
        ep.close()
        for a, b in pairs:
            a.close()
            b.close()


def test_the_gate_decision():
    from distgrad.transport.waiting import may_spin
    assert may_spin(2, 1, 0)            # only the asker runs: spin
    assert may_spin(2, 2, 0)            # one other thread runs: a core is free
    assert not may_spin(2, 3, 0)        # two others: no free core
    assert may_spin(2, 2, 1)            # the other is a spinner: the second core is free
    assert not may_spin(2, 3, 2)        # two spinners already
    assert not may_spin(4, 6, 0) and may_spin(4, 4, 0) and not may_spin(1, 1, 1)


def _gate_files(tmp_path, runnable: int):
    slots = tmp_path / "slots"
    load = tmp_path / "loadavg"
    load.write_text(f"0.50 0.40 0.30 {runnable}/321 4242\n")
    return slots, load


def _gates(w):
    gates = [("python", w._GATE.state, w._GATE.claim, w._GATE.release)]
    if w._waitc is not None:
        c = w._waitc
        gates.append(("native", lambda: c.gate_state(), c.gate_claim, c.gate_release))
    return gates


def test_the_gate_refuses_to_spin_without_a_free_core(w, tmp_path):
    ncpu = len(os.sched_getaffinity(0))
    slots, load = _gate_files(tmp_path, ncpu + 1)   # every core busy besides the asker
    assert w.setup_gate(str(slots), str(load))
    for name, state, claim, _ in _gates(w):
        assert state() == (ncpu, ncpu + 1, 0, False), name
        assert claim() is None, name
    load.write_text("0.50 0.40 0.30 1/321 4242\n")
    time.sleep(0.002)                                # past the 1 ms sample
    for name, state, claim, release in _gates(w):
        assert state() == (ncpu, 1, 0, True), name
        got = claim()
        assert got is not None and state()[2] == 1, name
        release(*got)
        assert state()[2] == 0, name


def _write_slot(path, i, pid, ms):
    with open(path, "r+b") as f:
        f.seek(i * 64)
        f.write(struct.pack("=Q", (pid << 32) | (ms & 0xFFFFFFFF)))


def test_spinners_are_counted_host_wide_and_a_dead_ones_slot_is_taken_over(w, tmp_path):
    ncpu = len(os.sched_getaffinity(0))
    slots, load = _gate_files(tmp_path, 1)
    assert w.setup_gate(str(slots), str(load))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now_ms = time.monotonic_ns() // 1_000_000
    for name, state, claim, release in _gates(w):
        # as many live spinners as CPUs (another process's, fresh): no room
        for i in range(ncpu):
            _write_slot(slots, i, dead.pid + 1 + i, time.monotonic_ns() // 1_000_000)
        assert state()[2:] == (ncpu, False), name
        assert claim() is None, name
        # they were killed while spinning: stale, not counted, and their slots reused
        for i in range(ncpu):
            _write_slot(slots, i, dead.pid, now_ms - 1000)
        assert state()[2:] == (0, True), name
        got = claim()
        assert got is not None and got[0] == 0 and got[1] >> 32 == os.getpid(), (name, got)
        release(*got)
    # a dead process never leaves the gate open either: its fresh slot counts until stale
    _write_slot(slots, 0, dead.pid, time.monotonic_ns() // 1_000_000)
    assert _gates(w)[-1][1]()[2] == 1


_TRUNCATED = """
import os, sys, time
from distgrad.transport import waiting as w
slots, load = sys.argv[1], sys.argv[2]
assert w.setup_gate(slots, load)
gates = [(w._GATE.claim, w._GATE.release, w._GATE.state)]
if w._waitc is not None:
    gates.append((w._waitc.gate_claim, w._waitc.gate_release, w._waitc.gate_state))
for claim, release, state in gates:
    got = claim()
    assert got is not None, got
    os.truncate(slots, 0)         # another process empties the file under us
    state()
    release(*got)
    got = claim()                 # a short file reads as free slots
    if got is not None:
        release(*got)
    os.truncate(slots, 0)
print("survived")
"""


def test_a_slot_file_truncated_under_a_spinner_costs_no_crash(tmp_path):
    """The slots are read and written with pread/pwrite, never mapped: a mapped file
    that another process truncates (or a full /dev/shm) raised SIGBUS on the next
    access, in both forms (the audit's repro: rc 135). Run in a child: a SIGBUS would
    kill pytest."""
    slots, load = _gate_files(tmp_path, 1)
    res = subprocess.run([sys.executable, "-c", _TRUNCATED, str(slots), str(load)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "survived", (res.returncode, res.stderr)


def test_without_loadavg_or_the_slot_file_nothing_spins(w, tmp_path):
    assert not w.setup_gate(str(tmp_path / "no-such-dir" / "slots"), "/proc/loadavg")
    assert not w.setup_gate(str(tmp_path / "slots"), str(tmp_path / "no-loadavg"))
    a, b = socket.socketpair()
    try:
        for name, wait_fd, _ in _forms(w):
            t0 = time.thread_time()
            assert wait_fd(b.fileno(), 200_000_000, 200) is False, name
            assert time.thread_time() - t0 < 0.05, name    # slept: no 200 ms spin
            assert _gates(w)[-1][2]() is None
    finally:
        a.close()
        b.close()


def test_the_budget_is_twice_the_average_plus_5us_and_none_above_the_cap():
    from distgrad.transport.waiting import Budget, budget_us
    assert budget_us(10.0, 30.0) == 25.0
    assert budget_us(14.0, 30.0) == 30.0      # capped
    assert budget_us(30.5, 30.0) == 0.0       # replies slower than the cap: sleep
    assert budget_us(0.0, 30.0) == 5.0
    b = Budget(cap_us=30.0, forced_us=None, native=True)
    assert b.spin_ns() == 0                   # nothing learned yet: sleep
    for _ in range(60):
        b.note(10e-6)
    assert b.spin_ns() == pytest.approx(25_000, rel=0.02)
    for _ in range(60):
        b.note(200e-6)                        # slower replies (sleeping waits included)
    assert b.spin_ns() == 0
    for _ in range(60):
        b.note(2e-6)                          # ... and it re-learns
    assert b.spin_ns() == pytest.approx(9_000, rel=0.05)
    big = Budget(cap_us=300.0, forced_us=None, native=True)
    for _ in range(60):
        big.note(100e-6)
    assert big.spin_ns() == pytest.approx(205_000, rel=0.02)
    assert Budget(cap_us=30.0, forced_us=250.0, native=False).spin_ns() == 250_000
    py = Budget(cap_us=30.0, forced_us=None, native=False)
    for _ in range(60):
        py.note(1e-6)
    assert py.spin_ns() == 0                  # the Python form spins only when told to


@pytest.mark.parametrize("var,value,said", [
    ("DISTGRAD_SPIN_CAP_US", "fast", "DISTGRAD_SPIN_CAP_US must be a number of microseconds"),
    ("DISTGRAD_SPIN_CAP_US", "-1", "DISTGRAD_SPIN_CAP_US must be a number of microseconds"),
    ("DISTGRAD_NATIVE_WAIT", "maybe", "DISTGRAD_NATIVE_WAIT must be 0 or 1"),
])
def test_a_bad_setting_stops_the_import_naming_it(var, value, said):
    res = subprocess.run([sys.executable, "-c", "import distgrad"], env={**os.environ, var: value},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and said in res.stderr, res.stderr


@pytest.mark.parametrize("env,want", [
    ({"DISTGRAD_PURE": "1"}, "python (DISTGRAD_PURE=1)"),
    ({"DISTGRAD_NATIVE_WAIT": "0"}, "python (DISTGRAD_NATIVE_WAIT=0)"),
])
def test_info_says_when_the_python_forms_run(env, want):
    out = subprocess.run([sys.executable, "-c", "import distgrad; print(distgrad.info()['native_wait'])"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.strip() == want


def test_a_stale_or_missing_build_of_the_native_wait_is_not_used(tmp_path, monkeypatch):
    from distgrad import _build
    pkg = tmp_path / "distgrad"
    (pkg / "transport").mkdir(parents=True)
    (pkg / "transport" / "_waitc.c").write_text("/* v2 */\n")
    monkeypatch.setattr(_build, "_PACKAGE_DIR", str(pkg))
    monkeypatch.setenv("DISTGRAD_PURE", "0")
    name = "distgrad.transport._waitc"
    assert _build._Chooser().must_interpret(name) == "not built"
    (pkg / "transport" / ("_waitc" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"")
    (pkg / _build.MANIFEST).write_text(json.dumps({name: "0" * 64}))
    assert _build._Chooser().must_interpret(name) == "source changed since it was built"
    digest = _build.source_digest(str(pkg / "transport" / "_waitc.c"))
    (pkg / _build.MANIFEST).write_text(json.dumps({name: digest}))
    assert _build._Chooser().must_interpret(name) is None


def _proc_cpu_s() -> float:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_IDLE = threading.Event()


def _start_idle() -> None:
    _IDLE.set()


def _idle_cpu(window: float) -> float:
    t0, c0 = time.monotonic(), _proc_cpu_s()
    time.sleep(window)
    return (_proc_cpu_s() - c0) / (time.monotonic() - t0)


def _pair(rank, world_size, want_native):
    import distgrad.rpc as rpc
    from distgrad.transport import waiting
    assert waiting.NATIVE == want_native, waiting.native_state()
    if rank == 0:
        outs = [rpc.rpc_sync("worker1", torch.add, args=(torch.ones(3), i)).tolist()
                for i in range(300)]
        futs = [rpc.rpc_async("worker1", torch.mul, args=(torch.ones(2), i)) for i in range(50)]
        outs2 = [f.wait().tolist() for f in futs]
        t = rpc.api._get_current_rpc_agent().transport
        learned = (t._reply_budget.avg_us, t._reply_budget.spin_ns())
        rpc.rpc_sync("worker1", _start_idle)
        return outs, outs2, _idle_cpu(2.0), learned
    assert _IDLE.wait(60 * SLOW)
    return _idle_cpu(2.0)


@pytest.mark.parametrize("env", [{}, {"DISTGRAD_SPIN_CAP_US": "300"}, {"DISTGRAD_PURE": "1"},
                                 {"DISTGRAD_NATIVE_WAIT": "0"}],
                         ids=["native", "native-cap300", "pure", "native-off"])
def test_a_worker_pair_serves_calls_and_idles_at_no_cpu(w, env):
    want_native = w.NATIVE and not env.get("DISTGRAD_PURE") and env.get("DISTGRAD_NATIVE_WAIT") != "0"
    got = run_workers(_pair, world_size=2, timeout=120 * SLOW, args=(want_native,),
                      env_per_rank={0: env, 1: env})
    outs, outs2, idle0, (avg_us, spin_ns) = got[0]
    print(f"reply waits: {avg_us:.1f} us on average, spin budget {spin_ns} ns")
    assert 0 < avg_us < 1e6     # learned from the calls
    assert outs == [[1.0 + i] * 3 for i in range(300)]
    assert outs2 == [[float(i)] * 2 for i in range(50)]
    for cpu in (idle0, got[1]):
        assert cpu < 0.05, got    # an idle worker: heartbeats only (the bench keeps < 1 %)


def _interrupted(rank, world_size, want_native, hold):
    import distgrad.rpc as rpc
    from distgrad.transport import waiting
    assert waiting.NATIVE == want_native, waiting.native_state()
    if rank != 0:
        return None
    rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))   # connected, budget learning
    from distgrad.transport import reading
    waits, real = [], reading._wait_fd
    reading._wait_fd = lambda *a: (waits.append(a), real(*a))[1]   # seen: it waited there

    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        rpc.rpc_sync("worker1", time.sleep, args=(hold,))
        took = None                       # not interrupted: the wait held the signal
    except KeyboardInterrupt:
        took = time.monotonic() - t0
    reading._wait_fd = real
    assert waits, "the caller did not wait for its reply in waiting.wait_fd"
    after = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 2)).tolist()
    return took, after


@pytest.mark.parametrize("env", [{}, {"DISTGRAD_PURE": "1"}], ids=["native", "pure"])
def test_ctrl_c_in_rpc_sync_raises_at_once_and_the_connection_still_serves(w, env):
    """A caller waiting for its reply (in C with the GIL released, or in Python) gets
    KeyboardInterrupt from its signal handler while the reply is seconds away."""
    want_native = w.NATIVE and not env.get("DISTGRAD_PURE")
    hold = 2 * SLOW + 2
    took, after = run_workers(_interrupted, world_size=2, timeout=120 * SLOW,
                              args=(want_native, hold), env_per_rank={0: env, 1: env})[0]
    assert took is not None and took < hold / 2, took
    assert after == [3.0]


def test_stats_count_the_spins_asked_refused_and_caught(w, tmp_path):
    ncpu = len(os.sched_getaffinity(0))
    slots, load = _gate_files(tmp_path, 1)
    assert w.setup_gate(str(slots), str(load))
    counters = [(w._py_wait_fd, lambda: list(w._COUNTS))]
    if w._waitc is not None:
        counters.append((w._waitc.wait_fd, w._waitc.stats))
    a, b = socket.socketpair()
    try:
        a.send(b"x")
        for wait_fd, counts in counters:
            before = counts()
            assert wait_fd(b.fileno(), 5_000_000, 100) is True    # ready at the first look
            assert wait_fd(b.fileno(), 0, 100) is True            # no budget: not a spin
            assert [x - y for x, y in zip(counts(), before)] == [1, 0, 1]
        load.write_text(f"0.50 0.40 0.30 {ncpu + 1}/321 4242\n")
        time.sleep(0.002)
        for wait_fd, counts in counters:
            before = counts()
            assert wait_fd(b.fileno(), 5_000_000, 100) is True    # the gate is shut: slept
            assert [x - y for x, y in zip(counts(), before)] == [1, 1, 0]
    finally:
        a.close()
        b.close()
    assert set(w.stats()) == {"asked", "refused", "caught"}
