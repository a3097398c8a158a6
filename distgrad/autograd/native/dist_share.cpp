// distgrad's native share of a distributed backward pass: one GraphTask of torch's own
// engine per worker per pass, fed by gradients arriving over RPC, and the native send and
// receive nodes it runs. The Python engine (distgrad/autograd/share.py) stays the
// reference and the fallback where no compiler exists; see docs/architecture.md,
// "Distributed backward".
//
// torch's engine runs the task: Engine::execute_with_graph_task on the thread that owns
// the share, with the caller's thread-local state, hooks, queue_callback, multi-grad
// hooks, graph freeing and anomaly checks as in any backward. This file computes the
// task's dependencies over the whole share (roots and every send function), captures
// the leaves' gradients into the distributed autograd context with torch's own
// AccumulateGrad::accumulateGrad rules, feeds arriving gradients into the running task,
// and retires send functions that will never receive one (an unused RPC result).
//
// GraphTask's constructor and ReadyQueue::push are not exported by libtorch (they are
// hidden symbols, not part of any API): the few definitions of them below follow the
// layout and behaviour of the headers this module is compiled against, and the module
// is built against the installed torch (distgrad/autograd/native/__init__.py).
#include <torch/extension.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/Event.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/autograd/context/container.h>
#include <pybind11/pybind11.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/Context.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <thread>
#include <chrono>
#include <queue>
#include <unordered_map>
#include <unordered_set>

namespace py = pybind11;
using namespace torch::autograd;

// ---- definitions of libtorch's hidden members used here -------------------------------
namespace torch::autograd {

namespace {
// Graph task ids of distgrad's tasks count down from INT_MAX (torch's count up from 0
// and are read back as int by get_current_graph_task_id): no clash in practice.
std::atomic<int64_t> dg_task_id{std::numeric_limits<int>::max()};
}  // namespace

GraphTask::GraphTask(bool keep_graph, bool grad_mode, int reentrant_depth,
                     std::shared_ptr<ReadyQueue> cpu_ready_queue,
                     c10::SmallVector<Node*, 4> graph_roots, bool exit_on_error)
    : keep_graph_(keep_graph),
      graph_roots_(std::move(graph_roots)),
      owner_(NO_DEVICE),
      reentrant_depth_(reentrant_depth),
      exit_on_error_(exit_on_error),
      cpu_ready_queue_(std::move(cpu_ready_queue)),
      future_result_(c10::make_intrusive<at::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))),
      id_(static_cast<uint64_t>(dg_task_id.fetch_sub(1))) {
  thread_locals_.set_grad_mode(grad_mode);
}

void ReadyQueue::push(NodeTask item, bool incrementOutstandingTasks) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (incrementOutstandingTasks) {
      std::shared_ptr<GraphTask> graph_task = item.base_.lock();
      TORCH_INTERNAL_ASSERT(graph_task, "GraphTask is no longer valid!");
      ++graph_task->outstanding_tasks_;
    }
    heap_.push(std::move(item));
  }
  not_empty_.notify_one();
}

bool ReadyQueue::empty() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return heap_.empty();
}

// the warning handler every GraphTask has (its vtable lives with these definitions)
void utils::DelayWarningHandler::process(const c10::Warning& warning) {
  std::lock_guard<std::mutex> lock(mutex_);
  warnings_.push_back(warning);
}

void utils::DelayWarningHandler::replay_warnings() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& warning : warnings_) {
    c10::warn(warning);
  }
  warnings_.clear();
}

int NodeTask::getReentrantDepth() const {
  std::shared_ptr<GraphTask> graph_task = base_.lock();
  if (graph_task) {
    return graph_task->reentrant_depth_;
  }
  return std::numeric_limits<int>::max();
}

}  // namespace torch::autograd

namespace distgrad {

struct EngineAccess : Engine {
  static void use_queue(Engine& e, std::shared_ptr<ReadyQueue> q) {
    (e.*(&EngineAccess::init_local_ready_queue))(std::move(q));
  }
};

// Python callables set once by distgrad.autograd.native (never freed: they live as long
// as the interpreter, and C++ objects holding no Python object need no GIL to die).
struct Callbacks {
  py::object ship;      // ship(share_id, context_id, msg_id, sender, grads, unreached, exp)
  py::object idle;      // idle(share_id, pieces, open): the queue ran dry; its weight, and
                        // whether send functions may still get gradients
  py::object enter;     // enter(share_id) -> token: a leaf capture begins (context current)
  py::object leave;     // leave(token)
  py::object grad_of;   // grad_of(share_id, leaf_node) -> Tensor | None (locks the context's gradients)
  py::object store;     // store(share_id, leaf_node, grad | None, event | None, stream id) (and unlocks them)
  py::object ddp;       // ddp(share_id, leaf_node) -> bool: a DDP parameter (autograd/ddp.py)
};
// set while some DistributedDataParallel exists in the process (autograd/ddp.py)
std::atomic<bool> ddp_on{false};
Callbacks* callbacks = nullptr;

thread_local int64_t tl_share = -1;   // the share whose task this thread drives

// distgrad's own Python (shipping a gradient, a weight report) runs inside the task's
// thread-local state, which carries the caller's dispatch and function modes: torch's
// engine does that work in C++, where no mode sees it, so neither may a mode here
struct NoUserModes {
  c10::impl::ExcludeDispatchKeyGuard no_dispatch_modes{
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot})};
  at::impl::TorchFunctionDisabledState prev = at::impl::PythonTorchFunctionTLS::get_disabled_state();
  NoUserModes() {
    at::impl::PythonTorchFunctionTLS::set_disabled_state(at::impl::TorchFunctionDisabledState::ALL_DISABLED);
  }
  ~NoUserModes() { at::impl::PythonTorchFunctionTLS::set_disabled_state(prev); }
};

struct DistShare;
std::mutex shares_mu;
std::unordered_map<int64_t, std::weak_ptr<DistShare>> shares;

// graph task id -> share id: a node of a share that runs on a device's thread of torch's
// engine (its forward ran on an accelerator) finds its share through the task that
// thread runs (torch's current graph task), not through tl_share, which only the
// thread driving the share has
std::unordered_map<uint64_t, int64_t> task_shares;

std::shared_ptr<DistShare> find_share(int64_t id) {
  std::lock_guard<std::mutex> g(shares_mu);
  auto it = shares.find(id);
  return it == shares.end() ? nullptr : it->second.lock();
}

// The share whose task this thread runs a node of (-1: none)
int64_t current_share() {
  if (tl_share >= 0) return tl_share;
  int task = get_current_graph_task_id();
  if (task < 0) return -1;
  std::lock_guard<std::mutex> g(shares_mu);
  auto it = task_shares.find(static_cast<uint64_t>(task));
  return it == task_shares.end() ? -1 : it->second;
}

// ---- the nodes ----------------------------------------------------------------------
struct SendRpcBackward : Node {
  explicit SendRpcBackward(edge_list&& edges) : Node(std::move(edges)) {}
  std::string name() const override { return "torch::distributed::autograd::SendRpcBackward"; }
  // torch's send function has no inputs: the gradients that came back over RPC are
  // set on it before the engine runs it (setGrads), and it hands them on. They are
  // kept per share (the task of the thread that runs it): two passes of one context
  // may feed one send function at once, and each runs it with its own.
  variable_list apply(variable_list&& inputs) override;
  void set_grads(int64_t share, variable_list grads) {
    std::lock_guard<std::mutex> g(mu_);
    grads_[share] = std::move(grads);
  }
  std::mutex mu_;
  std::unordered_map<int64_t, variable_list> grads_;
};

// A send function fed with some slots that no path reached runs as this stand-in,
// once: its edges are the send function's live ones (the dead slots' edges were killed
// at the feed), its hooks the send function's own, its gradients what came (undefined
// in the dead slots), its place in the queue the send function's sequence number.
struct PartialSend : Node {
  struct Pre : FunctionPreHook {
    explicit Pre(Node* send) : send(send) {}
    variable_list operator()(const variable_list& grads) override {
      variable_list out = grads;
      for (size_t i = 0; i < send->pre_hooks().size(); ++i) out = (*send->pre_hooks()[i])(out);
      return out;
    }
    Node* send;
  };
  struct Post : FunctionPostHook {
    explicit Post(Node* send) : send(send) {}
    variable_list operator()(const variable_list& outputs, const variable_list& inputs) override {
      variable_list out = outputs;
      for (size_t i = 0; i < send->post_hooks().size(); ++i) out = (*send->post_hooks()[i])(out, inputs);
      return out;
    }
    Node* send;
  };
  PartialSend(c10::intrusive_ptr<Node> send, edge_list&& live, variable_list grads)
      : Node(send->sequence_nr(), std::move(live)), send_(std::move(send)), grads_(std::move(grads)) {
    add_pre_hook(std::make_unique<Pre>(send_.get()));
    add_post_hook(std::make_unique<Post>(send_.get()));
  }
  std::string name() const override { return send_->name(); }
  variable_list apply(variable_list&&) override { return std::move(grads_); }
  c10::intrusive_ptr<Node> send_;
  variable_list grads_;
};

struct RecvRpcBackward : Node {
  RecvRpcBackward(int64_t context_id, int64_t msg_id, int64_t sender)
      : Node(), context_id(context_id), msg_id(msg_id), sender(sender) {}
  std::string name() const override { return "torch::distributed::autograd::RecvRpcBackward"; }
  variable_list apply(variable_list&& grads) override;
  int64_t context_id, msg_id, sender;
};

// A node of no graph that runs when a share's queue holds nothing else (its task's
// depth is below every real task's): the work an arrival started is then done.
struct IdleMarker : Node {
  explicit IdleMarker(int64_t share) : Node(0, edge_list()), share(share) {}
  std::string name() const override { return "distgrad::IdleMarker"; }
  variable_list apply(variable_list&& inputs) override;
  int64_t share;
};

struct DistShare : std::enable_shared_from_this<DistShare> {
  int64_t id = 0;
  // DDP's parameters: the torch distributed autograd context their gradients go to (DDP's
  // reducer reads and writes them there, as under torch's distributed engine), and the
  // parameters seen (their context's gradient taken in first)
  torch::distributed::autograd::ContextPtr tctx;
  std::unordered_set<c10::TensorImpl*> ddp_seen;
  std::shared_ptr<GraphTask> task;
  std::shared_ptr<ReadyQueue> queue;
  std::shared_ptr<GraphTask> marker_task;
  c10::intrusive_ptr<Node> root;
  c10::intrusive_ptr<IdleMarker> marker;
  std::mutex mu;               // closed, marker_pending
  bool closed = false;
  bool marker_pending = false;
  bool started = false;
  // per recv function: for each input slot, how many edges of the task still may feed it
  std::unordered_map<Node*, std::vector<int>> recv_feeders;
  // the weight this share holds (termination by weight throwing, distgrad/autograd/engine.py):
  // pieces of 2**-exp, added by arrivals, halved by shipped gradients, returned when idle
  std::vector<int64_t> pieces;
  // send functions whose gradients came while work was queued: they start once it ran
  // (first come, first served; the queue would otherwise put them first by sequence number)
  std::vector<c10::intrusive_ptr<Node>> deferred;
  // stand-ins of send functions fed with unreached slots (PartialSend) -> their send
  // functions, until their exec_info_ entries are made on the driving thread
  std::unordered_map<Node*, Node*> stand_ins;
  // every stand-in, kept until the share ends: an exec_info_ key is never a freed address
  std::vector<c10::intrusive_ptr<Node>> kept_stand_ins;
  bool reentrant_checkpoint = false;   // a reentrant checkpoint's node is in the share
  // a share of a pass started elsewhere ends by itself once every send function got its
  // gradients (or will get none) and nothing is queued: its task completes, as torch's
  // does once every send function ran (its final callbacks run then)
  bool auto_end = false;
  std::unordered_set<Node*> sends;      // the share's send functions
  std::vector<c10::intrusive_ptr<Node>> send_refs;   // ... held: their gradients for this
                                                      // share go when it does
  ~DistShare();
  std::unordered_set<Node*> consumed;   // ... fed or retired

  bool open_locked() const { return consumed.size() < sends.size(); }

  // half of the largest piece, for a gradient shipped (caller holds mu)
  int64_t split_locked() {
    TORCH_CHECK(!pieces.empty(), "distgrad: a gradient shipped without weight");
    auto it = std::min_element(pieces.begin(), pieces.end());
    *it += 1;
    return *it;
  }

  void push_marker_locked() {
    if (!marker_pending) {
      marker_pending = true;
      queue->push(NodeTask(marker_task, marker, InputBuffer(0)), true);
    }
  }
};

variable_list IdleMarker::apply(variable_list&&) {
  auto s = find_share(share);
  if (!s) return {};
  std::vector<int64_t> pieces;
  bool open = false;
  // A node of the task that runs on a device's thread of torch's engine (its forward
  // ran on an accelerator) is counted in the task's outstanding tasks (one of them is
  // the share's own hold) but is not in this queue: the share is not idle until it ran,
  // and what it queues here (or ships) comes after. Nothing tells this thread when it
  // ends if it queues nothing here, so the marker looks again, after a pause that
  // grows from 20 us to 1 ms while the device work lasts.
  for (int64_t pause_us = 20;; pause_us = std::min<int64_t>(pause_us * 2, 1000)) {
    {
      std::lock_guard<std::mutex> g(s->mu);
      if (!s->queue->empty() || s->task->outstanding_tasks_.load() <= 1) break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
  }
  {
    std::lock_guard<std::mutex> g(s->mu);
    s->marker_pending = false;
    if (!s->queue->empty()) {
      // work came in after this marker was taken: idle after it
      s->push_marker_locked();
      return {};
    }
    if (!s->deferred.empty()) {
      if (!s->stand_ins.empty()) {
        // a stand-in runs where its send function would (the task reads exec_info_
        // without a lock, on this thread only: it is not reading it now)
        std::lock_guard<std::mutex> tg(s->task->mutex_);
        auto& exec = s->task->exec_info_;
        if (!exec.empty()) {
          for (auto& [stand_in, send] : s->stand_ins) {
            auto it = exec.find(send);
            exec[stand_in].needed_ = it != exec.end() && it->second.needed_;
          }
        }
        s->stand_ins.clear();
      }
      for (auto& n : s->deferred) s->queue->push(NodeTask(s->task, n, InputBuffer(0)), true);
      s->deferred.clear();
      s->push_marker_locked();
      return {};
    }
    if (s->auto_end && !s->open_locked() && !s->closed) {
      // done here: the task completes; the thread driving it returns the weight after
      s->closed = true;
      s->queue->push(NodeTask(s->task, c10::intrusive_ptr<Node>(), InputBuffer(0)), false);
      return {};
    }
    pieces.swap(s->pieces);
    open = s->open_locked();
  }
  if (pieces.empty()) return {};
  NoUserModes no_modes;
  py::gil_scoped_acquire gil;
  callbacks->idle(share, py::cast(pieces), open);
  return {};
}

DistShare::~DistShare() {
  {
    std::lock_guard<std::mutex> g(shares_mu);
    shares.erase(id);
    if (task) task_shares.erase(task->id_);
  }
  for (auto& n : send_refs) {
    if (auto* sn = dynamic_cast<SendRpcBackward*>(n.get())) {
      variable_list left;   // (freed outside the node's mutex)
      std::lock_guard<std::mutex> g(sn->mu_);
      auto it = sn->grads_.find(id);
      if (it != sn->grads_.end()) {
        left = std::move(it->second);
        sn->grads_.erase(it);
      }
    }
  }
}

variable_list SendRpcBackward::apply(variable_list&& inputs) {
  if (!inputs.empty()) {
    // run by a plain engine call that starts at its inputs (the Python engine's
    // regions): an identity per slot
    return std::move(inputs);
  }
  variable_list out;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = grads_.find(current_share());
    if (it != grads_.end()) {
      out = std::move(it->second);
      grads_.erase(it);
    }
  }
  if (out.empty()) out.resize(num_outputs());
  return out;
}

variable_list RecvRpcBackward::apply(variable_list&& grads) {
  std::vector<int64_t> unreached;
  int64_t share = current_share();
  int64_t exp = -1;
  if (auto s = find_share(share)) {
    {
      std::lock_guard<std::mutex> g(s->task->mutex_);
      auto it = s->recv_feeders.find(this);
      if (it != s->recv_feeders.end()) {
        for (size_t i = 0; i < it->second.size(); ++i) {
          if (it->second[i] == 0) unreached.push_back(static_cast<int64_t>(i));
        }
      }
    }
    std::lock_guard<std::mutex> g(s->mu);
    exp = s->split_locked();
  } else {
    share = -1;
  }
  NoUserModes no_modes;
  py::gil_scoped_acquire gil;
  py::list gs;
  for (auto& t : grads) {
    if (t.defined()) gs.append(py::cast(t)); else gs.append(py::none());
  }
  callbacks->ship(share, context_id, msg_id, sender, gs, py::cast(unreached), exp);
  return {};
}

// torch's DistAutogradContext::accumulateGrad (private; its friends are torch's engine
// classes): reached through an explicit instantiation, which the language lets name a
// private member
using AccumulateFn = void (torch::distributed::autograd::DistAutogradContext::*)(
    const at::Tensor&, const at::Tensor&, size_t);
struct AccumulateTag {
  friend AccumulateFn accumulate_of(AccumulateTag);
};
template <AccumulateFn F>
struct AccumulateRob {
  friend AccumulateFn accumulate_of(AccumulateTag) { return F; }
};
template struct AccumulateRob<&torch::distributed::autograd::DistAutogradContext::accumulateGrad>;
AccumulateFn accumulate_of(AccumulateTag);

// A DDP parameter's gradient, as torch's DistAccumulateGradCaptureHook takes it: the
// share's torch context current on this thread (DDP's hook finds it there), the node's
// pre-hooks, the gradient added into that context, the node's post-hooks (DDP's); what
// the distgrad context held for the parameter goes into the torch context first, the
// same tensor (torch's context then adds to it in place where it can).
at::Tensor ddp_capture(DistShare& s, AccumulateGrad& acc, py::object leaf, const at::Tensor& grad) {
  namespace dga = torch::distributed::autograd;
  auto& container = dga::DistAutogradContainer::getInstance();
  if (!s.tctx) {
    static std::atomic<int64_t> taken{0};
    s.tctx = container.getOrCreateContext(container.getMaxId() - taken.fetch_add(1));
  }
  const auto& var = acc.variable;
  if (s.ddp_seen.insert(var.unsafeGetTensorImpl()).second) {
    py::object old_obj = callbacks->grad_of(s.id, leaf);
    at::Tensor old = old_obj.is_none() ? at::Tensor() : old_obj.cast<at::Tensor>();
    callbacks->store(s.id, leaf, py::none(), py::none(), 0);   // (unlocks the context's gradients)
    if (old.defined()) {
      py::gil_scoped_release nogil;
      at::AutoGradMode no_grad(false);
      ((*s.tctx).*accumulate_of(AccumulateTag{}))(var, old, 1000);   // kept as it is
    }
  }
  py::gil_scoped_release nogil;
  dga::ThreadLocalDistAutogradContext guard{dga::ContextPtr(s.tctx)};
  variable_list inputGrads = {grad};
  for (const auto& hook : acc.pre_hooks()) inputGrads = (*hook)(inputGrads);
  if (inputGrads[0].defined()) {
    at::AutoGradMode no_grad(false);
    ((*s.tctx).*accumulate_of(AccumulateTag{}))(var, inputGrads[0], 3);
  }
  const variable_list kEmpty;
  for (const auto& hook : acc.post_hooks()) (*hook)(kEmpty, inputGrads);
  return inputGrads[0];
}

// The capture of a leaf's gradient, as torch's distributed engine does it: the
// AccumulateGrad node's pre-hooks, the gradient added into the context by torch's
// AccumulateGrad::accumulateGrad rules (steal, view or copy), its post-hooks. The
// context is current while they run. AccumulateGrad itself never runs: .grad is untouched.
struct LeafCapture : GraphTask::ExecInfo::Capture::GradCaptureHook {
  LeafCapture(c10::intrusive_ptr<AccumulateGrad> acc, int64_t share)
      : acc_(std::move(acc)), share_(share) {}
  at::Tensor operator()(const at::Tensor& grad) override {
    py::gil_scoped_acquire gil;
    if (ddp_on.load() && callbacks->ddp) {
      // a DDP parameter: its gradient goes to the share's torch context (ddp_capture)
      py::object leaf = py::reinterpret_steal<py::object>(functionToPyObject(acc_));
      if (callbacks->ddp(share_, leaf).cast<bool>()) {
        if (auto s = find_share(share_)) return ddp_capture(*s, *acc_, leaf, grad);
      }
    }
    py::object token = callbacks->enter(share_);
    struct Leave {
      py::object& t;
      ~Leave() {
        try { callbacks->leave(t); } catch (...) {}   // (a destructor must not throw)
      }
    } leave{token};
    variable_list inputGrads = {grad};
    for (const auto& hook : acc_->pre_hooks()) {
      inputGrads = (*hook)(inputGrads);
    }
    if (inputGrads[0].defined()) {
      py::object leaf = py::reinterpret_steal<py::object>(functionToPyObject(acc_));
      py::object old_obj = callbacks->grad_of(share_, leaf);
      at::Tensor result;
      bool updated = false;
      py::object ready = py::none();   // an event after the accumulation (a device's)
      int64_t ready_on = 0;
      struct Store {   // always called: it also unlocks the context's gradients
        int64_t share; py::object& leaf; at::Tensor& result; bool& updated; py::object& ready;
        int64_t& ready_on;
        ~Store() {
          try {
            callbacks->store(share, leaf, updated ? py::cast(result) : py::none(), ready, ready_on);
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("distgrad: storing a leaf's gradient in the context");
          } catch (...) {
          }
        }
      } store{share_, leaf, result, updated, ready, ready_on};
      at::Tensor old = old_obj.is_none() ? at::Tensor() : old_obj.cast<at::Tensor>();
      old_obj = py::none();
      {
        auto forward_stream = acc_->stream();
        c10::OptionalStreamGuard stream_guard(forward_stream);
        at::AutoGradMode grad_mode(false);
        // references to the gradient here, as in torch's capture hook: this list, the
        // task's captured variable, and the engine's input buffer
        AccumulateGrad::accumulateGrad(
            acc_->variable, old, inputGrads[0], 3,
            [&](at::Tensor&& g) { result = std::move(g); updated = true; });
        // as torch's context records a gradient's readiness (recordGradEvent): an event on
        // the stream the accumulation ran on, which get_gradients makes its reader wait for
        const auto device = acc_->variable.device();
        if (!device.is_cpu() && !device.is_meta()) {
          c10::impl::VirtualGuardImpl impl{device.type()};
          const auto stream = impl.getStream(device);
          PyObject* ev = THPEvent_new(device.type(), c10::EventFlag::PYTORCH_DEFAULT);
          if (!ev) throw py::error_already_set();
          ready = py::reinterpret_steal<py::object>(ev);
          reinterpret_cast<THPEvent*>(ev)->event.record(stream);
          ready_on = stream.id();
        }
      }
    }
    const variable_list kEmpty;
    for (const auto& hook : acc_->post_hooks()) {
      (*hook)(kEmpty, inputGrads);
    }
    return inputGrads[0];
  }
  c10::intrusive_ptr<AccumulateGrad> acc_;
  int64_t share_;
};

// Gradients that came over RPC for a send function were placed on their devices on the
// feeding thread's current streams; the engine takes them as made on the send function's
// stream (its forward's: the first device input's). That stream waits for an event
// recorded where they were placed, and keeps them (record_stream) while it uses them; a
// gradient on another device of the node (a call that sent tensors of several devices)
// has its device synchronized instead, as no stream of the engine's is known to use it.
void order_arrivals(Node& node, const variable_list& grads) {
  const auto node_stream = node.stream();
  for (const auto& g : grads) {
    if (!g.defined() || g.device().is_cpu() || g.device().is_meta()) continue;
    const auto device = g.device();
    c10::impl::VirtualGuardImpl impl{device.type()};
    const auto placed = impl.getStream(device);
    if (node_stream.has_value() && node_stream->device() == device) {
      if (placed != *node_stream) {
        c10::Event ev{device.type()};
        ev.record(placed);
        node_stream->wait(ev);
        impl.recordDataPtrOnStream(g.storage().data_ptr(), *node_stream);
      }
    } else {
      impl.synchronizeDevice(device.index());
    }
  }
}

std::atomic<int64_t> next_share{1};

c10::intrusive_ptr<Node> node_of(py::handle obj) {
  TORCH_CHECK(THPCppFunction_Check(obj.ptr()), "expected a native autograd node");
  return reinterpret_cast<THPCppFunction*>(obj.ptr())->cdata;
}

// ---- building a share ---------------------------------------------------------------
// torch's GraphTask::stash_current_streams (not exported): the creating thread's current
// stream on each accelerator device in use, which the task's post-processing syncs with
// the streams its leaves' gradients were made on (torch's "stream semantics of backward
// passes"); an empty list there would be read past its end
void stash_current_streams(GraphTask& task) {
  const auto acc = at::getAccelerator();
  if (!acc.has_value()) return;
  c10::impl::VirtualGuardImpl impl{*acc};
  const auto n = impl.deviceCount();
  task.caller_current_streams_.assign(static_cast<size_t>(std::max<c10::DeviceIndex>(n, 0)), std::nullopt);
  const auto& hooks = at::globalContext().getAcceleratorHooksInterface(*acc);
  for (c10::DeviceIndex i = 0; i < n; ++i) {
    if (hooks.hasPrimaryContext(i)) task.caller_current_streams_[i] = impl.getStream({*acc, i});
  }
}

std::shared_ptr<DistShare> make_share(bool keep_graph, bool grad_mode,
                                      const std::vector<at::Tensor>& roots,
                                      const std::vector<at::Tensor>& root_grads,
                                      py::list send_nodes) {
  auto s = std::make_shared<DistShare>();
  s->id = next_share++;
  s->queue = std::make_shared<ReadyQueue>();
  edge_list root_edges;
  for (const auto& r : roots) root_edges.push_back(impl::gradient_edge(r));
  s->root = c10::make_intrusive<GraphRoot>(std::move(root_edges), root_grads);
  std::vector<c10::intrusive_ptr<Node>> sends;
  for (auto h : send_nodes) {
    sends.push_back(node_of(h));
    s->sends.insert(sends.back().get());
  }
  s->auto_end = roots.empty();
  s->send_refs = sends;

  c10::SmallVector<Node*, 4> graph_roots{s->root.get()};
  for (auto& n : sends) graph_roots.push_back(n.get());
  // exit_on_error: an error anywhere ends the task (its future carries the error)
  s->task = std::make_shared<GraphTask>(keep_graph, grad_mode, 0, s->queue,
                                        std::move(graph_roots), /*exit_on_error=*/true);
  stash_current_streams(*s->task);
  s->marker_task = std::make_shared<GraphTask>(false, false, -1, s->queue,
                                               c10::SmallVector<Node*, 4>{}, false);
  s->marker_task->owner_ = CPU_DEVICE;   // completes on the thread that runs the share
  s->marker = c10::make_intrusive<IdleMarker>(s->id);
  auto& task = *s->task;

  // dependencies over the whole share: the roots and every send function
  std::unordered_set<Node*> seen;
  std::queue<Node*> q;
  q.push(s->root.get());
  for (auto& n : sends) q.push(n.get());
  edge_list outputs;
  std::vector<Node*> recvs;
  while (!q.empty()) {
    Node* fn = q.front();
    q.pop();
    for (const auto& edge : fn->next_edges()) {
      Node* next = edge.function.get();
      if (!next) continue;
      task.dependencies_[next] += 1;
      if (auto* r = dynamic_cast<RecvRpcBackward*>(next)) {
        auto& f = s->recv_feeders[r];
        if (f.size() < r->num_inputs()) f.resize(r->num_inputs(), 0);
        f[edge.input_nr] += 1;
      }
      if (seen.insert(next).second) {
        q.push(next);
        // (nodes_in_graph_ stays empty, as torch's DistEngine leaves it: so
        // torch.autograd.graph._will_engine_execute_node is False in a distributed
        // backward, and a multi-grad hook in mode "all" never fires, as under torch)
        if (next->name() == "CheckpointFunctionBackward") s->reentrant_checkpoint = true;
        if (next->next_edges().empty()) {
          if (dynamic_cast<RecvRpcBackward*>(next)) {
            recvs.push_back(next);
            outputs.emplace_back(edge);
          } else if (dynamic_cast<AccumulateGrad*>(next)) {
            outputs.emplace_back(edge);
          }
        }
      }
    }
  }
  // which nodes run: those with a path to a leaf or a recv function (torch's
  // init_to_execute over a root that points at the roots and every send function)
  if (!outputs.empty()) {
    auto& exec = task.exec_info_;
    exec[s->root.get()].needed_ = true;
    int idx = 0;
    std::unordered_set<Node*> captured;
    for (auto& e : outputs) {
      Node* fn = e.function.get();
      if (!dynamic_cast<AccumulateGrad*>(fn)) continue;
      if (!captured.insert(fn).second) continue;
      auto& info = exec[fn];
      if (!info.captures_) {
        info.captures_ = std::make_unique<std::vector<GraphTask::ExecInfo::Capture>>();
      }
      info.captures_->emplace_back(0, idx++);
      auto acc = c10::intrusive_ptr<AccumulateGrad>::reclaim_copy(static_cast<AccumulateGrad*>(fn));
      info.captures_->back().DO_NOT_USE_DEPRECATED_register_capture_hook(
          std::make_unique<LeafCapture>(std::move(acc), s->id));
    }
    task.captured_vars_.resize(idx);
    for (Node* r : recvs) exec[r].needed_ = true;
    // post-order over everything: needed = some next node is needed or captured
    std::unordered_map<Node*, bool> done;
    struct Frame { Node* fn; size_t next; };
    std::vector<Frame> stack;
    std::vector<Node*> starts{s->root.get()};
    for (auto& n : sends) starts.push_back(n.get());
    for (Node* start : starts) {
      if (done.count(start)) continue;
      stack.push_back({start, 0});
      done[start] = false;
      while (!stack.empty()) {
        auto& fr = stack.back();
        const auto& nexts = fr.fn->next_edges();
        if (fr.next < nexts.size()) {
          Node* n = nexts[fr.next++].function.get();
          if (n && !done.count(n)) {
            done[n] = false;
            stack.push_back({n, 0});
          }
          continue;
        }
        auto it = exec.find(fr.fn);
        bool already = it != exec.end() && it->second.should_execute();
        if (!already) {
          bool needed = false;
          for (const auto& e : nexts) {
            auto jt = exec.find(e.function.get());
            if (jt != exec.end() && jt->second.should_execute()) { needed = true; break; }
          }
          if (needed) exec[fr.fn].needed_ = true;
        }
        stack.pop_back();
      }
    }
    for (auto& n : sends) exec[n.get()].needed_ = true;
  } else {
    // nothing to capture or ship: mark everything needed (no exec info means "run all")
  }
  task.outstanding_tasks_ = 1;   // held until the pass ends everywhere (release())
  {
    std::lock_guard<std::mutex> g(shares_mu);
    shares[s->id] = s;
    task_shares[s->task->id_] = s->id;
  }
  return s;
}

// Kill the edges of a node that will not run: the nodes behind lose a dependency; one
// whose last dependency goes runs with what it got, or, if nothing reached it, does
// not run and kills its own edges. Returns recv functions nothing reached (they still
// tell their senders). Caller holds task->mutex_.
void kill_edges(DistShare& s, std::vector<std::pair<Node*, uint32_t>> work,
                std::vector<c10::intrusive_ptr<Node>>& dead_recvs) {
  auto& task = *s.task;
  while (!work.empty()) {
    auto [next, input_nr] = work.back();
    work.pop_back();
    auto rf = s.recv_feeders.find(next);
    if (rf != s.recv_feeders.end() && input_nr < rf->second.size()) rf->second[input_nr] -= 1;
    auto it = task.dependencies_.find(next);
    if (it == task.dependencies_.end()) continue;
    if (--it->second != 0) continue;
    task.dependencies_.erase(it);
    auto nr = task.not_ready_.find(next);
    if (nr != task.not_ready_.end()) {
      auto buf = std::move(nr->second);
      task.not_ready_.erase(nr);
      s.queue->push(NodeTask(s.task, next->getptr(), std::move(buf)), true);
      continue;
    }
    if (!task.exec_info_.empty()) {
      auto ei = task.exec_info_.find(next);
      if (ei == task.exec_info_.end() || !ei->second.should_execute()) continue;
    }
    if (dynamic_cast<RecvRpcBackward*>(next)) {
      dead_recvs.push_back(next->getptr());
      continue;
    }
    for (const auto& e : next->next_edges())
      if (e.function) work.emplace_back(e.function.get(), e.input_nr);
  }
}

std::vector<std::pair<Node*, uint32_t>> edges_of(Node* fn) {
  std::vector<std::pair<Node*, uint32_t>> out;
  for (const auto& e : fn->next_edges())
    if (e.function) out.emplace_back(e.function.get(), e.input_nr);
  return out;
}

// Recv functions no path reached still tell their senders (all slots unreached): a
// sender may be waiting for them. Caller holds s.mu (not the GIL).
void ship_dead(DistShare& s, std::vector<c10::intrusive_ptr<Node>>& dead) {
  if (dead.empty()) return;
  std::vector<int64_t> exps;
  for (size_t k = 0; k < dead.size(); ++k) exps.push_back(s.split_locked());
  NoUserModes no_modes;
  py::gil_scoped_acquire gil;
  for (size_t k = 0; k < dead.size(); ++k) {
    auto* r = static_cast<RecvRpcBackward*>(dead[k].get());
    py::list gs;
    std::vector<int64_t> all;
    for (size_t i = 0; i < r->num_inputs(); ++i) { gs.append(py::none()); all.push_back(i); }
    callbacks->ship(s.id, r->context_id, r->msg_id, r->sender, gs, py::cast(all), exps[k]);
  }
  dead.clear();
}

}  // namespace distgrad

using namespace distgrad;

// Python types of the nodes: torch shows its send function as a "SendRpcBackward" and
// its recv function as a plain "CppFunction"; distgrad's recv function also tells its
// (context id, message id, sender) as ``dg_info``.
static PyObject* recv_dg_info(PyObject* self, void*) {
  HANDLE_TH_ERRORS
  auto* r = dynamic_cast<RecvRpcBackward*>(reinterpret_cast<THPCppFunction*>(self)->cdata.get());
  if (!r) Py_RETURN_NONE;
  return py::make_tuple(r->context_id, r->msg_id, r->sender).release().ptr();
  END_HANDLE_TH_ERRORS
}
static PyGetSetDef send_props[] = {THP_FUNCTION_DEFAULT_PROPERTIES, {nullptr}};
static PyGetSetDef recv_props[] = {
    THP_FUNCTION_DEFAULT_PROPERTIES,
    {(char*)"dg_info", recv_dg_info, nullptr, nullptr, nullptr},
    {nullptr}};
static PyMethodDef node_methods[] = {
    {(char*)"_register_hook_dict", THPCppFunction_register_hook_dict, METH_O, nullptr},
    {(char*)"register_hook", THPCppFunction_register_hook, METH_O, nullptr},
    {(char*)"register_prehook", THPCppFunction_register_prehook, METH_O, nullptr},
    {(char*)"name", THPCppFunction_name, METH_NOARGS, nullptr},
    {(char*)"_sequence_nr", THPCppFunction_sequence_nr, METH_NOARGS, nullptr},
    {nullptr}};
static PyTypeObject SendType;
static PyTypeObject RecvType;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  _initFunctionPyTypeObject(SendType, "SendRpcBackward", send_props, node_methods);
  registerCppFunction(typeid(SendRpcBackward), &SendType);
  _initFunctionPyTypeObject(RecvType, "CppFunction", recv_props, node_methods);
  registerCppFunction(typeid(RecvRpcBackward), &RecvType);
  Py_INCREF(&SendType);
  Py_INCREF(&RecvType);
  m.attr("SendType") = py::handle(reinterpret_cast<PyObject*>(&SendType));
  m.attr("RecvType") = py::handle(reinterpret_cast<PyObject*>(&RecvType));

  m.doc() = "distgrad's native share of a distributed backward pass (one GraphTask a worker a pass)";

  m.def("set_ddp", [](py::object cb, bool on) {
    if (!callbacks) callbacks = new Callbacks();
    callbacks->ddp = cb;
    ddp_on = on;
  });


  m.def("set_callbacks", [](py::object ship, py::object idle, py::object enter, py::object leave,
                            py::object grad_of, py::object store) {
    if (!callbacks) callbacks = new Callbacks();
    callbacks->ship = ship; callbacks->idle = idle; callbacks->enter = enter;
    callbacks->leave = leave; callbacks->grad_of = grad_of; callbacks->store = store;
  });

  // record_send(tensors) -> send node (its next edges: the tensors' gradient edges),
  // without the GIL: a leaf's gradient accumulator is found under the leaf's own lock
  m.def("record_send", [](const std::vector<at::Tensor>& tensors) {
    c10::intrusive_ptr<Node> node;
    {
      py::gil_scoped_release nogil;
      edge_list edges;
      edges.reserve(tensors.size());
      for (const auto& t : tensors) edges.push_back(impl::gradient_edge(t));
      node = c10::make_intrusive<SendRpcBackward>(std::move(edges));
      for (const auto& t : tensors) node->add_input_metadata(t);
    }
    return py::reinterpret_steal<py::object>(functionToPyObject(node));
  });

  // record_recv(context_id, msg_id, sender, tensors): the recv node becomes the grad_fn
  // of every tensor (they require grad); returns the node
  m.def("record_recv", [](int64_t context_id, int64_t msg_id, int64_t sender,
                          std::vector<at::Tensor> tensors) {
    auto node = c10::make_intrusive<RecvRpcBackward>(context_id, msg_id, sender);
    for (auto& t : tensors) {
      auto nr = node->add_input_metadata(t);
      impl::set_gradient_edge(t, Edge(node, nr));
    }
    return py::reinterpret_steal<py::object>(functionToPyObject(node));
  });

  // node_stream(node) -> (device, stream id) | None: the stream torch's engine runs a
  // C++ node on (its first accelerator input's; Node::stream), for graph pictures
  m.def("node_stream", [](py::handle obj) -> py::object {
    if (!THPCppFunction_Check(obj.ptr())) return py::none();
    auto s = node_of(obj)->stream();
    if (!s.has_value()) return py::none();
    return py::make_tuple(c10::Device(s->device()).str(), s->id());
  });

  m.def("is_send", [](py::handle obj) {
    return THPCppFunction_Check(obj.ptr()) &&
           dynamic_cast<SendRpcBackward*>(node_of(obj).get()) != nullptr;
  });
  m.def("is_recv", [](py::handle obj) {
    return THPCppFunction_Check(obj.ptr()) &&
           dynamic_cast<RecvRpcBackward*>(node_of(obj).get()) != nullptr;
  });
  m.def("recv_info", [](py::handle obj) {
    auto* r = dynamic_cast<RecvRpcBackward*>(node_of(obj).get());
    TORCH_CHECK(r, "not a recv function");
    return py::make_tuple(r->context_id, r->msg_id, r->sender);
  });

  py::class_<DistShare, std::shared_ptr<DistShare>>(m, "Share")
      .def(py::init(&make_share))
      .def_property_readonly("id", [](DistShare& s) { return s.id; })
      .def_property_readonly("task_id", [](DistShare& s) { return static_cast<int64_t>(s.task->id_); })
      // run(): drive the task on this thread until the pass ends here (release()),
      // without the GIL; raises the task's error
      .def("run", [](std::shared_ptr<DistShare> s, std::optional<int64_t> exp) {
        // (never wait for a share's mutex holding the GIL: a thread holding the mutex
        // may be waiting for the GIL to ship a gradient)
        int64_t prev = tl_share;
        tl_share = s->id;
        c10::intrusive_ptr<at::ivalue::Future> fut;
        try {
          py::gil_scoped_release nogil;
          {
            std::lock_guard<std::mutex> g(s->mu);
            TORCH_CHECK(!s->started, "a share runs once");
            s->started = true;
            if (exp.has_value()) s->pieces.push_back(*exp);
            s->push_marker_locked();
          }
          auto& engine = Engine::get_default_engine();
          EngineAccess::use_queue(engine, s->queue);
          fut = engine.execute_with_graph_task(s->task, s->root, InputBuffer(0));
          std::lock_guard<std::mutex> g(s->mu);
          s->closed = true;
        } catch (...) {
          tl_share = prev;
          throw;
        }
        tl_share = prev;
        s->task->warning_handler_.replay_warnings();
        if (fut->hasError()) {
          // the task lets go of the error before it is raised: a Python error's
          // traceback holds frames that hold this share, so a task that kept it would
          // close a cycle through C++ that no collector sees (a failed hook's
          // gradient stayed for ever)
          s->task->future_result_ = c10::make_intrusive<at::ivalue::Future>(
              c10::ListType::create(c10::TensorType::get()));
          fut->value();  // rethrows
        }
      })
      // feed(send_node, grads): gradients for a send function arrived; slots listed in
      // ``unreached`` got no path from the roots (what lies behind them must not run)
      .def("feed", [](DistShare& s, py::handle send, std::vector<std::optional<at::Tensor>> grads,
                      std::vector<int64_t> unreached, int64_t exp) {
        auto node = node_of(send);
        auto* sn = dynamic_cast<SendRpcBackward*>(node.get());
        TORCH_CHECK(sn, "feed: not a send function");
        variable_list gs;
        for (auto& g : grads) gs.push_back(g.has_value() ? *g : at::Tensor());
        std::vector<c10::intrusive_ptr<Node>> dead;
        {
          py::gil_scoped_release nogil;
          order_arrivals(*node, gs);
          std::lock_guard<std::mutex> g(s.mu);
          if (s.closed) return false;
          if (!s.consumed.insert(node.get()).second) {
            // it got its gradients already, or was retired (its recv function was dead
            // and discovery did not reach it): nothing more runs behind it
            s.pieces.push_back(exp);
            s.push_marker_locked();
            return true;
          }
          if (unreached.empty()) {
            sn->set_grads(s.id, std::move(gs));
            s.deferred.push_back(node);
          } else {
            // only the reached slots feed the nodes behind; the others' edges die now,
            // and the send function runs (its hooks see undefined gradients there) as a
            // stand-in that has only the live edges
            std::lock_guard<std::mutex> tg(s.task->mutex_);
            std::vector<bool> dead_slot(node->num_outputs(), false);
            for (auto i : unreached) if (i >= 0 && (size_t)i < dead_slot.size()) dead_slot[i] = true;
            gs.resize(node->num_outputs());
            edge_list live;
            for (size_t i = 0; i < node->num_outputs(); ++i) {
              const auto& e = node->next_edge(i);
              if (dead_slot[i]) {
                gs[i] = at::Tensor();
                live.emplace_back();
                if (e.function) kill_edges(s, {{e.function.get(), e.input_nr}}, dead);
              } else {
                live.push_back(e);
              }
            }
            auto stand_in = c10::make_intrusive<PartialSend>(node, std::move(live), std::move(gs));
            s.stand_ins.emplace(stand_in.get(), node.get());
            s.kept_stand_ins.push_back(stand_in);
            s.deferred.push_back(stand_in);
          }
          s.pieces.push_back(exp);
          ship_dead(s, dead);
          s.push_marker_locked();
        }
        return true;
      })
      // retire(send_nodes): these send functions will receive no gradient in this pass
      .def("retire", [](DistShare& s, py::list sends, py::list reached, int64_t exp) {
        std::vector<c10::intrusive_ptr<Node>> nodes;
        for (auto h : sends) nodes.push_back(node_of(h));
        std::unordered_set<Node*> reached_recvs;
        for (auto h : reached) reached_recvs.insert(node_of(h).get());
        std::vector<c10::intrusive_ptr<Node>> dead;
        {
          py::gil_scoped_release nogil;
          std::lock_guard<std::mutex> g(s.mu);
          if (s.closed) return false;
          s.pieces.push_back(exp);
          {
            std::lock_guard<std::mutex> tg(s.task->mutex_);
            for (auto& n : nodes) {
              if (!s.consumed.insert(n.get()).second) continue;
              kill_edges(s, edges_of(n.get()), dead);
            }
          }
          // a recv function that died with them tells its sender only if discovery
          // reached it (the sender waits for that send function); one it did not
          // reach tells nobody: its sender retires that send function in this round
          // (a Python engine there has already left it out of its count)
          std::vector<c10::intrusive_ptr<Node>> reached_dead;
          for (auto& r : dead)
            if (reached_recvs.count(r.get())) reached_dead.push_back(r);
          dead.clear();
          ship_dead(s, reached_dead);
          s.push_marker_locked();
        }
        return true;
      })
      // half of the largest piece of weight this share holds, for a gradient it ships
      .def("split", [](DistShare& s) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(s.mu);
        return s.split_locked();
      })
      // what weight is left (the share ended: run() returned or raised)
      // ddp_gradients() -> [(parameter, gradient)]: what the share's torch context holds
      // (DDP's results once the task ended), and the context goes (ids count down from
      // the container's largest, where torch's own, counting up, never reach)
      .def("ddp_gradients", [](DistShare& s) {
        py::list out;
        if (!s.tctx) return out;
        auto grads = s.tctx->getGradients();
        for (const auto& kv : grads) out.append(py::make_tuple(kv.key(), kv.value()));
        auto id = s.tctx->contextId();
        s.tctx.reset();
        s.ddp_seen.clear();
        torch::distributed::autograd::DistAutogradContainer::getInstance().releaseContextIfPresent(id);
        return out;
      })
      .def("take_pieces", [](DistShare& s) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(s.mu);
        std::vector<int64_t> out;
        out.swap(s.pieces);
        return out;
      })
      .def_property_readonly("reentrant_checkpoint", [](DistShare& s) { return s.reentrant_checkpoint; })
      // whether nodes wait for gradients that have not come (a send function's, maybe never)
      .def("blocked", [](DistShare& s) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> tg(s.task->mutex_);
        return !s.task->not_ready_.empty();
      })
      .def("has_final_callbacks", [](DistShare& s) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(s.task->final_callbacks_lock_);
        return !s.task->final_callbacks_.empty();
      })
      // release(): the pass ended everywhere: the task completes (final callbacks run)
      // on the thread driving it
      .def("release", [](DistShare& s) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(s.mu);
        if (s.closed) return;
        s.closed = true;
        s.queue->push(NodeTask(s.task, c10::intrusive_ptr<Node>(), InputBuffer(0)), false);
      })
      // abort(): stop running (the pass failed elsewhere)
      .def("abort", [](DistShare& s) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(s.mu);
        if (s.closed) return;
        s.closed = true;
        s.task->has_error_ = true;
        if (!s.task->future_completed_.exchange(true)) {
          s.task->future_result_->setErrorIfNeeded(std::make_exception_ptr(
              std::runtime_error("distributed backward pass aborted")));
        }
        s.queue->push(NodeTask(s.task, c10::intrusive_ptr<Node>(), InputBuffer(0)), false);
      })
      .def("forget", [](DistShare& s) {
        std::lock_guard<std::mutex> g(shares_mu);
        shares.erase(s.id);
      });
}
