"""A failed RPC future raises a new copy of its error at each wait(), as torch's do,
so that the waiting frames never join a cycle through the (C++) future: with
``set_exception``'s one object, a frame holding the future leaked with its locals."""
import gc
import weakref

import pytest
import torch

from distgrad.rpc.future_errors import fail, fresh


class Holder:
    def __init__(self, fut):
        self.fut = fut

    def get(self):
        return self.fut.wait()


class NeedsKeyword(Exception):
    def __init__(self, msg, *, code):
        super().__init__(msg)
        self.code = code


def _waits_and_catches(fut, payload):
    try:
        fut.wait()
    except KeyError:
        return True
    return False


def test_a_frame_that_holds_the_future_is_freed_after_its_wait_raised():
    fut = torch.futures.Future()
    fail(fut, KeyError("k"))
    payload = torch.ones(4)
    ref = weakref.ref(payload)
    assert _waits_and_catches(fut, payload)
    h = Holder(fut)
    with pytest.raises(KeyError):
        h.get()
    href = weakref.ref(h)
    del payload, h
    gc.collect()
    assert ref() is None and href() is None
    # set_exception's one object keeps them (why fail() exists)
    fut2 = torch.futures.Future()
    fut2.set_exception(KeyError("k"))
    h2 = Holder(fut2)
    with pytest.raises(KeyError):
        h2.get()
    href2 = weakref.ref(h2)
    del h2
    gc.collect()
    assert href2() is not None


def test_each_wait_raises_a_copy_with_the_same_type_args_attributes_and_cause():
    cause = ValueError("why")
    err = RuntimeError("boom")
    err.__cause__ = cause
    err.worker_name = "worker3"
    fut = torch.futures.Future()
    fail(fut, err)
    got = []
    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom") as ei:
            fut.wait()
        got.append(ei.value)
    assert got[0] is not got[1] and got[0] is not err
    assert all(e.worker_name == "worker3" and e.__cause__ is cause for e in got)
    with pytest.raises(RuntimeError, match="boom"):
        fut.value()
    # then() and callbacks see the error as with set_exception
    seen = []
    fut.add_done_callback(lambda f: seen.append(pytest.raises(RuntimeError, f.wait)))
    assert seen and isinstance(seen[0].value, RuntimeError)
    with pytest.raises(RuntimeError, match="boom"):
        fut.then(lambda f: f.wait()).wait()
    with pytest.raises(RuntimeError, match="boom"):   # as with set_exception
        torch.futures.collect_all([fut]).wait()


class Prefixed(Exception):
    def __init__(self, msg):
        super().__init__("Prefix: " + msg)
        self.inits = getattr(self, "inits", 0) + 1


def test_a_copy_does_not_run_a_python_init_again():
    err = Prefixed("x")
    new = fresh(err)
    assert new is not err and str(new) == "Prefix: x" and new.inits == 1
    new = fresh(NeedsKeyword("m", code=7))   # (its __init__ would not take its own args)
    assert type(new) is NeedsKeyword and str(new) == "m" and new.code == 7
    assert fresh(SystemExit(3)).code == 3 and fresh(StopIteration(5)).value == 5


def test_an_error_that_cannot_be_rebuilt_is_raised_itself():
    class Odd(Exception):
        def __new__(cls, *args, **kwargs):
            if not kwargs:
                raise TypeError("needs a keyword")
            return super().__new__(cls)

        def __init__(self, *args, code):
            super().__init__(*args)
            self.code = code
    err = Odd("m", code=7)
    assert fresh(err) is err
    fut = torch.futures.Future()
    fail(fut, err)
    with pytest.raises(Odd) as ei:
        fut.wait()
    assert ei.value is err and ei.value.code == 7
