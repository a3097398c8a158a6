"""Cost of torch.init_num_threads() (distgrad.rpc.pool.follow_intra_op_threads) per call,
on a non-main thread, with the global count unset (-1) and set (set_num_threads path:
omp + mkl_set_num_threads_local + mkl_set_dynamic + pthreadpool + mkldnn cache clear).
Also: does it slow a following mkldnn conv2d (at::native::mkldnn::clear_computation_cache)?
    python cost.py
"""
import threading, timeit, json
import torch

res = {}


def measure(tag):
    n = 200000
    t = timeit.timeit(torch.init_num_threads, number=n) / n
    base = timeit.timeit(lambda: None, number=n) / n
    res[tag] = {"init_num_threads_us": round(t * 1e6, 3), "empty_lambda_us": round(base * 1e6, 3)}


def conv(tag):
    x = torch.randn(1, 16, 32, 32)
    w = torch.randn(16, 16, 3, 3)
    f = lambda: torch.nn.functional.conv2d(x, w, padding=1)
    g = lambda: (torch.init_num_threads(), torch.nn.functional.conv2d(x, w, padding=1))
    for _ in range(50):
        f(); g()
    r = []
    for _ in range(5):
        a = timeit.timeit(f, number=500) / 500
        b = timeit.timeit(g, number=500) / 500
        r.append((round(a * 1e6, 1), round(b * 1e6, 1)))
    res[tag] = {"conv_us(plain, init+conv)": r}


def on_thread(fn, tag):
    t = threading.Thread(target=fn, args=(tag,)); t.start(); t.join()


on_thread(measure, "thread_global_unset")
on_thread(conv, "conv_global_unset")
torch.set_num_threads(2)
on_thread(measure, "thread_global_set_2")
on_thread(conv, "conv_global_set_2")
torch.set_num_threads(1)
on_thread(measure, "thread_global_set_1")
on_thread(conv, "conv_global_set_1")
print(json.dumps(res, indent=1))
