"""Does init_num_threads (=> at::set_num_threads => mkldnn clear_computation_cache when the
global count is set) slow an mkldnn conv2d that follows it on the same thread?
Interleaved, median of 41 rounds of 200 calls.   python conv_cache.py
"""
import statistics, threading, timeit, torch

def run(out):
    x = torch.randn(1, 16, 32, 32); w = torch.randn(16, 16, 3, 3)
    f = lambda: torch.nn.functional.conv2d(x, w, padding=1)
    g = lambda: (torch.init_num_threads(), f())
    for _ in range(100): f(); g()
    a, b = [], []
    for _ in range(41):
        a.append(timeit.timeit(f, number=200) / 200); b.append(timeit.timeit(g, number=200) / 200)
    out.update(plain_us=round(statistics.median(a) * 1e6, 1), init_then_conv_us=round(statistics.median(b) * 1e6, 1))

for n in (1, 2):
    torch.set_num_threads(n); o = {}
    t = threading.Thread(target=run, args=(o,)); t.start(); t.join()
    print("global", n, o)
