// weft's c10d::Backend: the C++ object torch dispatches to, over weft's
// Python Backend (weft/_backend.py), built against the installed torch by
// weft/_c10d/__init__.py.
//
// Why it exists: torch's Python backend trampoline (PyBackend) wraps every
// Work a Python backend returns in a holder that forwards only wait() and
// get_future(), so is_completed(), source_rank() (recv from any rank) and
// exception() are lost wherever torch builds the group around the backend;
// and a Python backend runs Python code on every op. So:
// - the common ops on dense contiguous CPU tensors go straight to weft's C
//   API (native.hpp: `fast_*` below), with a Work answered in C++;
// - every other call goes to the Python object this is the C++ half of
//   (whose class derives from this one), its Work kept whole: `Work` below
//   forwards every query to weft's Python Work, `Window` every call to
//   weft's Python Window.
//
// Invariants: every call into Python holds the GIL; a Python error raised
// there, or one weft's C API returns, propagates as
// pybind11::error_already_set, which torch's bindings turn back into the
// Python exception (its torch.distributed type kept).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Window.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/Hooks.hpp>

#include "native.hpp"

#include <atomic>
#include <iostream>
#include <map>
#include <mutex>

#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace weft_c10d {

// A backend's completion hooks (c10d's CompletionHook: told once per Work
// that finished successfully; they must not take the GIL).
class CompletionHooks {
 public:
  void add(int64_t id, c10d::CompletionHook hook) {
    std::lock_guard<std::mutex> g(mutex_);
    hooks_[id] = std::move(hook);
  }
  void remove(int64_t id) {
    std::lock_guard<std::mutex> g(mutex_);
    hooks_.erase(id);
  }
  // Tell every hook that the Work of `key` finished (called without the GIL).
  void fire(uint64_t key) {
    std::vector<c10d::CompletionHook> now;
    {
      std::lock_guard<std::mutex> g(mutex_);
      for (auto& [id, hook] : hooks_) {
        now.push_back(hook);
      }
    }
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    for (auto& hook : now) {
      hook(args);
    }
  }

 private:
  std::mutex mutex_;
  std::map<int64_t, c10d::CompletionHook> hooks_;
};

// A backend's abort hooks (c10d's AbortHook), run once, in id order,
// without the GIL: torch's flight recorder dumps its trace from one, and
// that dump takes the GIL on other threads.
class AbortHooks {
 public:
  void add(int64_t id, c10d::AbortHook hook) {
    std::lock_guard<std::mutex> g(mutex_);
    hooks_[id] = std::move(hook);
  }
  void remove(int64_t id) {
    std::lock_guard<std::mutex> g(mutex_);
    hooks_.erase(id);
  }
  void fire() {
    std::map<int64_t, c10d::AbortHook> now;
    {
      std::lock_guard<std::mutex> g(mutex_);
      if (fired_) {
        return;
      }
      fired_ = true;
      now.swap(hooks_);
    }
    for (auto& [id, hook] : now) {
      try {
        hook();
      } catch (const std::exception& e) {
        // One hook's failure must not stop the abort, nor the other hooks.
        std::cerr << "weft: abort hook " << id << " failed: " << e.what() << std::endl;
      }
    }
  }

 private:
  std::mutex mutex_;
  std::map<int64_t, c10d::AbortHook> hooks_;
  bool fired_ = false;
};

// One op's Work as c10d sees it: weft's Python Work, every query forwarded.
// Its backend's completion hooks hear of it once, when a wait or a query
// first finds it finished successfully (weft has no watchdog thread).
class Work : public c10d::Work {
 public:
  Work(py::object work, std::shared_ptr<CompletionHooks> hooks) : work_(std::move(work)), hooks_(std::move(hooks)) {}

  ~Work() override {
    py::gil_scoped_acquire gil;
    work_ = py::object();
  }

  bool isCompleted() override {
    bool done = call<bool>("is_completed");
    if (done && call<bool>("is_success")) {
      finished();
    }
    return done;
  }

  bool isSuccess() const override {
    return call<bool>("is_success");
  }

  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object e = work_.attr("exception")();
    if (e.is_none()) {
      return nullptr;
    }
    return std::make_exception_ptr(std::runtime_error(py::str(e).cast<std::string>()));
  }

  int sourceRank() const override {
    return call<int>("source_rank");
  }

  std::vector<at::Tensor> result() override {
    return call<std::vector<at::Tensor>>("result");
  }

  void synchronize() override {
    call("synchronize");
  }

  bool wait(std::chrono::milliseconds timeout) override {
    bool done = false;
    {
      py::gil_scoped_acquire gil;
      py::object t = timeout.count() <= 0 ? py::none() : py::cast(timeout);
      done = work_.attr("wait")(t).cast<bool>();
    }
    if (done) {
      finished();  // wait raises what failed
    }
    return done;
  }

  void blockCurrentStream() override {
    call("block_current_stream");
  }

  float getDuration() const override {
    return call<float>("_get_duration");
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    py::gil_scoped_acquire gil;
    py::object f = work_.attr("get_future")();
    return f.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  }

 private:
  // The Python Work's method `name`, called under the GIL, its result
  // converted (and the Python result released) before the GIL is.
  template <typename T = void>
  T call(const char* name) const {
    py::gil_scoped_acquire gil;
    py::object r = work_.attr(name)();
    if constexpr (!std::is_void_v<T>) {
      return r.cast<T>();
    }
  }

  // The op finished successfully: tell the hooks, once.
  void finished() {
    if (hooks_ != nullptr && !fired_.exchange(true)) {
      hooks_->fire(getCompletionKey());
    }
  }

  py::object work_;
  std::shared_ptr<CompletionHooks> hooks_;
  std::atomic<bool> fired_{false};
};

// The Work of what a Python op returned (None: no Work), told to `hooks`.
inline c10::intrusive_ptr<c10d::Work> wrap(py::object o, std::shared_ptr<CompletionHooks> hooks = nullptr) {
  if (o.is_none()) {
    return {};
  }
  return c10::make_intrusive<Work>(std::move(o), std::move(hooks));
}

// A window (weft/_window.py's Window) as c10d sees it.
class Window : public c10d::Window {
 public:
  explicit Window(py::object window) : window_(std::move(window)) {}

  ~Window() override {
    py::gil_scoped_acquire gil;
    window_ = py::object();
  }

  void tensor_register(const at::Tensor& t, bool owning) override {
    py::gil_scoped_acquire gil;
    window_.attr("tensor_register")(t, owning);
  }
  void tensor_deregister() override {
    py::gil_scoped_acquire gil;
    window_.attr("tensor_deregister")();
  }
  c10::intrusive_ptr<c10d::Work> put(const at::Tensor& t, int64_t dst, int64_t offset, bool async_op, const c10d::PutOptions& o)
      override {
    py::gil_scoped_acquire gil;
    return wrap(window_.attr("put")(t, dst, offset, async_op, o));
  }
  at::Tensor map_remote_tensor(int64_t rank) override {
    py::gil_scoped_acquire gil;
    return window_.attr("map_remote_tensor")(rank).cast<at::Tensor>();
  }
  c10::intrusive_ptr<c10d::Work> signal(int64_t peer, bool async_op, const c10d::SignalOptions& o) override {
    py::gil_scoped_acquire gil;
    return wrap(window_.attr("signal")(peer, async_op, o));
  }
  c10::intrusive_ptr<c10d::Work> wait_signal(int64_t peer, bool async_op, const c10d::WaitSignalOptions& o) override {
    py::gil_scoped_acquire gil;
    return wrap(window_.attr("wait_signal")(peer, async_op, o));
  }
  c10d::WindowAttr get_attr(int64_t peer) override {
    py::gil_scoped_acquire gil;
    return window_.attr("get_attr")(peer).cast<c10d::WindowAttr>();
  }

 private:
  py::object window_;
};

using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;

// An op: call the Python method `pyname` of this backend and keep its Work
// whole; without one, c10d's base method (which says it is unsupported).
#define WEFT_PY_OP(cname, pyname, ...)   \
  do {                                   \
    py::gil_scoped_acquire gil;          \
    py::function f = method(pyname);     \
    if (!f) {                            \
      return c10d::Backend::cname(__VA_ARGS__); \
    }                                    \
    return wrap(f(__VA_ARGS__), hooks_); \
  } while (false)

// An op weft's C API may take: `fast(...)` (a method below) issues it
// without Python where its tensors and options allow (and returns its
// Work), else the Python method does (it stages what the C API cannot
// take).
#define WEFT_OP(cname, pyname, ...)                \
  do {                                             \
    if (native_ready()) {                          \
      if (WorkPtr w = fast_##cname(__VA_ARGS__)) { \
        return w;                                  \
      }                                            \
    }                                              \
    WEFT_PY_OP(cname, pyname, __VA_ARGS__);        \
  } while (false)

// weft's backend: each virtual of c10d::Backend issues the op through weft's
// C API where it can (WEFT_OP), else calls the Python method of the same
// meaning on the Python object this is the C++ half of.
class Backend : public c10d::Backend {
 public:
  using c10d::Backend::Backend;

  // -- ops ---------------------------------------------------------------
  WorkPtr broadcast(Tensors& t, const c10d::BroadcastOptions& o) override {
    WEFT_OP(broadcast, "broadcast", t, o);
  }
  WorkPtr allreduce(Tensors& t, const c10d::AllreduceOptions& o) override {
    WEFT_OP(allreduce, "allreduce", t, o);
  }
  WorkPtr allreduce_sparse(Tensors& t, const c10d::AllreduceOptions& o) override {
    WEFT_PY_OP(allreduce_sparse, "allreduce_sparse", t, o);
  }
  WorkPtr allreduce_coalesced(Tensors& t, const c10d::AllreduceCoalescedOptions& o) override {
    WEFT_PY_OP(allreduce_coalesced, "allreduce_coalesced", t, o);
  }
  WorkPtr reduce(Tensors& t, const c10d::ReduceOptions& o) override {
    WEFT_OP(reduce, "reduce", t, o);
  }
  WorkPtr allgather(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    WEFT_OP(allgather, "allgather", out, in, o);
  }
  WorkPtr all_gather_single(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    WEFT_OP(all_gather_single, "all_gather_single", out, in, o);
  }
  WorkPtr allgather_coalesced(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    WEFT_PY_OP(allgather_coalesced, "allgather_coalesced", out, in, o);
  }
  WorkPtr all_gather_single_coalesced(Tensors& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    WEFT_PY_OP(all_gather_single_coalesced, "all_gather_single_coalesced", out, in, o);
  }
  WorkPtr gather(TensorLists& out, Tensors& in, const c10d::GatherOptions& o) override {
    WEFT_PY_OP(gather, "gather", out, in, o);
  }
  WorkPtr gather_single(at::Tensor& out, at::Tensor& in, const c10d::GatherOptions& o) override {
    WEFT_PY_OP(gather_single, "gather_single", out, in, o);
  }
  WorkPtr scatter(Tensors& out, TensorLists& in, const c10d::ScatterOptions& o) override {
    WEFT_PY_OP(scatter, "scatter", out, in, o);
  }
  WorkPtr reduce_scatter(Tensors& out, TensorLists& in, const c10d::ReduceScatterOptions& o) override {
    WEFT_PY_OP(reduce_scatter, "reduce_scatter", out, in, o);
  }
  WorkPtr reduce_scatter_single(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    WEFT_OP(reduce_scatter_single, "reduce_scatter_single", out, in, o);
  }
  WorkPtr reduce_scatter_single_coalesced(Tensors& out, Tensors& in, const c10d::ReduceScatterOptions& o) override {
    WEFT_PY_OP(reduce_scatter_single_coalesced, "reduce_scatter_single_coalesced", out, in, o);
  }
  WorkPtr all_to_all_single(
      at::Tensor& out,
      at::Tensor& in,
      std::vector<int64_t>& out_splits,
      std::vector<int64_t>& in_splits,
      const c10d::AllToAllOptions& o) override {
    WEFT_OP(all_to_all_single, "all_to_all_single", out, in, out_splits, in_splits, o);
  }
  WorkPtr alltoall(Tensors& out, Tensors& in, const c10d::AllToAllOptions& o) override {
    WEFT_OP(alltoall, "alltoall", out, in, o);
  }
  WorkPtr send(Tensors& t, int dst, int tag) override {
    WEFT_OP(send, "send", t, dst, tag);
  }
  WorkPtr recv(Tensors& t, int src, int tag) override {
    WEFT_OP(recv, "recv", t, src, tag);
  }
  WorkPtr recvAnysource(Tensors& t, int tag) override {
    WEFT_OP(recvAnysource, "recv_anysource", t, tag);
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override {
    WEFT_OP(barrier, "barrier", o);
  }
  void startCoalescing() override {
    py::gil_scoped_acquire gil;
    call("start_coalescing");
  }
  WorkPtr endCoalescing() override {
    WEFT_PY_OP(endCoalescing, "end_coalescing");
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    py::gil_scoped_acquire gil;
    call("monitored_barrier", o, wait_all_ranks);
  }

  // -- what the group is and can do ----------------------------------------
  const std::string getBackendName() const override {
    return "weft";
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    py::gil_scoped_acquire gil;
    return self().attr("options").cast<c10::intrusive_ptr<Options>>();
  }
  bool supportsSplitting() const override {
    py::gil_scoped_acquire gil;
    return flag("supports_splitting");
  }
  bool supportsCoalescing() const override {
    py::gil_scoped_acquire gil;
    return flag("supports_coalescing");
  }
  bool supportsShrinking() const override {
    py::gil_scoped_acquire gil;
    return flag("supports_shrinking");
  }
  bool supportsWindow() const override {
    py::gil_scoped_acquire gil;
    return flag("supports_window");
  }
  bool supportsReconfigure() const override {
    py::gil_scoped_acquire gil;
    return flag("supports_reconfigure");
  }
  bool supportsTimeEstimation() const override {
    py::gil_scoped_acquire gil;
    return flag("_supports_time_estimate");
  }
  bool supportsAbortHooks() const override {
    return true;
  }
  bool supportsTensorAlloc(c10::DeviceIndex device) override {
    py::gil_scoped_acquire gil;
    return call("supports_tensor_alloc", device).cast<bool>();
  }
  // c10d asks for a sequence number the same on every rank (DETAIL
  // debugging); weft checks its own order.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override {
    return 0;
  }

  // -- new groups and windows ----------------------------------------------
  BackendPtr split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks, const c10::intrusive_ptr<Options>& o)
      override {
    py::gil_scoped_acquire gil;
    return backend(call("split", store, ranks, o));
  }
  BackendPtr shrink(const std::vector<int64_t>& exclude, int flags, const c10::intrusive_ptr<Options>& o) override {
    py::gil_scoped_acquire gil;
    return backend(call("shrink", exclude, flags, o));
  }
  c10::intrusive_ptr<c10d::Window> new_window(const std::optional<at::Tensor>& tensor) override {
    py::gil_scoped_acquire gil;
    return c10::make_intrusive<Window>(call("new_window", tensor));
  }

  // -- errors, timeouts, lifecycle -----------------------------------------
  c10d::ErrorType getError() override {
    py::gil_scoped_acquire gil;
    return call("get_error").cast<c10d::ErrorType>();
  }
  void setTimeout(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    call("set_timeout", timeout);
  }
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override {
    aborts_->add(id, std::move(hook));
  }
  void unregisterAbortHook(int64_t id) override {
    aborts_->remove(id);
  }
  // Run the abort hooks (once): weft's group calls this, through the
  // Python Backend, just before it aborts its transports.
  void fireAbortHooks() {
    aborts_->fire();
  }
  bool supportsCompletionHooks() const override {
    return true;
  }
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override {
    hooks_->add(id, std::move(hook));
  }
  void unregisterCompletionHook(int64_t id) override {
    hooks_->remove(id);
  }
  void abort() override {
    py::gil_scoped_acquire gil;
    call("abort");
  }
  void shutdown() override {
    py::gil_scoped_acquire gil;
    call("shutdown");
  }

  // -- weft's C API (native.hpp) -------------------------------------------
  ~Backend() override {
    if (group_ != nullptr) {
      api_->group_release(group_);
    }
  }
  // Issue the ops weft's C API takes through it from now on: `group` is
  // the native group's `_torch_handle()` (this backend gives it back),
  // `table` the capsule `_weft.TORCH_API`, `timeout` the group's (s).
  void bindNative(uintptr_t group, const py::capsule& table, double timeout) {
    auto* api = static_cast<const api::Table*>(PyCapsule_GetPointer(table.ptr(), "weft._weft.TORCH_API"));
    if (api == nullptr) {
      throw py::error_already_set();
    }
    TORCH_CHECK(api->version == api::kVersion, "weft: its C API is version ", api->version, ", its C++ backend expects ", api::kVersion);
    TORCH_CHECK(group_ == nullptr, "weft: this backend already has its group");
    api_ = api;
    group_ = reinterpret_cast<const api::Group*>(group);
    setNativeTimeout(timeout);
  }
  // The group's timeout (s) for the ops issued through the C API.
  void setNativeTimeout(double seconds) {
    timeout_ms_.store(std::max<int64_t>(1, static_cast<int64_t>(seconds * 1000.0)));
  }
  // While the group coalesces, ops go through Python (which batches them).
  void setCoalescing(bool on) {
    coalescing_.store(on);
  }

 private:
  // The Python object this is the C++ half of.
  py::object self() const {
    return py::cast(this);
  }
  // Its method `name` (defined in the Python class), or none.
  py::function method(const char* name) const {
    return py::get_override(static_cast<const Backend*>(this), name);
  }
  // The helpers below run with the GIL held (every caller takes it first,
  // so the Python objects they return are released under it too).

  // Call its method `name`, which it must have.
  template <typename... Args>
  py::object call(const char* name, Args&&... args) const {
    return self().attr(name)(std::forward<Args>(args)...);
  }
  bool flag(const char* name) const {
    return self().attr(name).cast<bool>();
  }
  // A Backend a Python method returned (None: none).
  static BackendPtr backend(const py::object& o) {
    if (o.is_none()) {
      return {};
    }
    return o.cast<BackendPtr>();
  }

  // -- the ops weft's C API takes (each returns null where it cannot) ------
  bool native_ready() const {
    return group_ != nullptr && !coalescing_.load(std::memory_order_relaxed);
  }
  int64_t timeout_of(std::chrono::milliseconds t) const {
    return t.count() > 0 ? t.count() : timeout_ms_.load(std::memory_order_relaxed);
  }
  api::OpArgs args(uint32_t kind, std::chrono::milliseconds timeout, bool direct) const {
    api::OpArgs a{};
    a.kind = kind;
    a.timeout_ms = timeout_of(timeout);
    a.direct = direct ? 1 : 0;
    return a;
  }
  static bool plain(const c10d::ReduceOp& op) {
    return op.op_ < c10d::ReduceOp::PREMUL_SUM;
  }

  // Start `ops` (each `OpArgs` with its tensors described); the Work holds
  // `keep` and gives `outputs` as its result (its future `nested` where
  // that is a list per input). On a failure to start, the
  // ops started before it keep running, their tensors held, and the error
  // is raised.
  WorkPtr start(
      std::vector<api::OpArgs>& ops,
      std::vector<at::Tensor> keep,
      std::vector<at::Tensor> outputs,
      c10d::OpType type,
      std::optional<TensorLists> nested = std::nullopt) {
    auto held = std::make_shared<std::vector<at::Tensor>>(std::move(keep));
    std::vector<api::OpHandle*> started;
    started.reserve(ops.size());
    // A direct op runs here: never with the GIL held (torch's bindings
    // release it; a C++ caller might not have).
    std::unique_ptr<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) {
      nogil = std::make_unique<py::gil_scoped_release>();
    }
    for (auto& a : ops) {
      PyObject* err = nullptr;
      api::OpHandle* op = api_->start(group_, &a, &err);
      if (op == nullptr) {
        nogil.reset();
        // Its destructor hands the started ops back to weft, which holds
        // their tensors until they end.
        c10::make_intrusive<NativeWork>(api_, std::move(started), held, Tensors{}, getRank(), type, nullptr).reset();
        raise(err);
      }
      started.push_back(op);
    }
    auto hooks = hooks_;
    return c10::make_intrusive<NativeWork>(
        api_,
        std::move(started),
        std::move(held),
        std::move(outputs),
        getRank(),
        type,
        [hooks](uint64_t key) { hooks->fire(key); },
        std::move(nested));
  }

  // One op per tensor of `t`, each writing it (all_reduce, broadcast, reduce).
  WorkPtr per_tensor(Tensors& t, api::OpArgs a, c10d::OpType type) {
    if (!takes_all(t)) {
      return {};
    }
    std::vector<api::TensorArg> targs;
    targs.reserve(t.size());
    for (auto& x : t) {
      targs.push_back(arg(x));
    }
    std::vector<api::OpArgs> ops(t.size(), a);
    for (size_t i = 0; i < t.size(); ++i) {
      ops[i].outs = &targs[i];
      ops[i].n_outs = 1;
    }
    return start(ops, t, t, type);
  }

  WorkPtr fast_allreduce(Tensors& t, const c10d::AllreduceOptions& o) {
    if (!plain(o.reduceOp) || o.sparseIndices.has_value()) {
      return {};
    }
    auto a = args(api::ALL_REDUCE, o.timeout, !o.asyncOp);
    a.reduce = o.reduceOp.op_;
    return per_tensor(t, a, c10d::OpType::ALLREDUCE);
  }
  WorkPtr fast_broadcast(Tensors& t, const c10d::BroadcastOptions& o) {
    auto a = args(api::BROADCAST, o.timeout, !o.asyncOp);
    a.peer = o.rootRank;
    return per_tensor(t, a, c10d::OpType::BROADCAST);
  }
  WorkPtr fast_reduce(Tensors& t, const c10d::ReduceOptions& o) {
    if (!plain(o.reduceOp)) {
      return {};
    }
    auto a = args(api::REDUCE, o.timeout, !o.asyncOp);
    a.peer = o.rootRank;
    a.reduce = o.reduceOp.op_;
    return per_tensor(t, a, c10d::OpType::REDUCE);
  }
  WorkPtr fast_allgather(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) {
    if (out.size() != in.size() || !takes_all(in)) {
      return {};
    }
    std::vector<std::vector<api::TensorArg>> outs(out.size());
    std::vector<api::TensorArg> ins;
    Tensors keep(in);
    for (size_t i = 0; i < out.size(); ++i) {
      for (auto& x : out[i]) {
        if (!takes(x) || x.numel() != in[i].numel()) {
          return {};  // uneven or staged: Python's
        }
        outs[i].push_back(arg(x));
        keep.push_back(x);
      }
      ins.push_back(arg(in[i]));
    }
    std::vector<api::OpArgs> ops(out.size(), args(api::ALL_GATHER, o.timeout, !o.asyncOp));
    for (size_t i = 0; i < out.size(); ++i) {
      ops[i].outs = outs[i].data();
      ops[i].n_outs = outs[i].size();
      ops[i].ins = &ins[i];
      ops[i].n_ins = 1;
    }
    Tensors outputs;
    for (auto& l : out) {
      outputs.insert(outputs.end(), l.begin(), l.end());
    }
    return start(ops, std::move(keep), std::move(outputs), c10d::OpType::ALLGATHER, out);
  }
  // One op from `in` into `out` (the single-tensor collectives).
  WorkPtr one_to_one(at::Tensor& out, at::Tensor& in, api::OpArgs a, c10d::OpType type) {
    if (!takes(out) || !takes(in)) {
      return {};
    }
    api::TensorArg o = arg(out), i = arg(in);
    a.outs = &o;
    a.n_outs = 1;
    a.ins = &i;
    a.n_ins = 1;
    std::vector<api::OpArgs> ops{a};
    return start(ops, Tensors{out, in}, Tensors{out}, type);
  }
  WorkPtr fast_all_gather_single(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) {
    return one_to_one(out, in, args(api::ALL_GATHER_SINGLE, o.timeout, !o.asyncOp), c10d::OpType::_ALLGATHER_BASE);
  }
  WorkPtr fast_reduce_scatter_single(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) {
    if (!plain(o.reduceOp)) {
      return {};
    }
    auto a = args(api::REDUCE_SCATTER_SINGLE, o.timeout, !o.asyncOp);
    a.reduce = o.reduceOp.op_;
    return one_to_one(out, in, a, c10d::OpType::_REDUCE_SCATTER_BASE);
  }
  WorkPtr fast_all_to_all_single(
      at::Tensor& out,
      at::Tensor& in,
      std::vector<int64_t>& out_splits,
      std::vector<int64_t>& in_splits,
      const c10d::AllToAllOptions& o) {
    auto a = args(api::ALL_TO_ALL_SINGLE, o.timeout, !o.asyncOp);
    // torch's split sizes count rows of dim 0; weft's count elements. One
    // side missing is equal parts of its tensor.
    std::vector<uint64_t> outs, ins;
    if (!out_splits.empty() || !in_splits.empty()) {
      size_t world = static_cast<size_t>(getSize());
      auto elements = [world](const at::Tensor& t, const std::vector<int64_t>& splits) {
        std::vector<uint64_t> e;
        int64_t row = t.dim() > 0 && t.size(0) > 0 ? t.numel() / t.size(0) : 1;
        if (splits.empty()) {
          e.assign(world, static_cast<uint64_t>(t.numel()) / world);
        } else {
          for (auto s : splits) {
            e.push_back(s < 0 ? UINT64_MAX : static_cast<uint64_t>(s * row));
          }
        }
        return e;
      };
      outs = elements(out, out_splits);
      ins = elements(in, in_splits);
      auto negative = [](const std::vector<uint64_t>& e) { return std::find(e.begin(), e.end(), UINT64_MAX) != e.end(); };
      if (outs.size() != world || ins.size() != world || negative(outs) || negative(ins)) {
        return {};  // Python's, which says what is wrong
      }
      a.out_splits = outs.data();
      a.in_splits = ins.data();
      a.n_splits = world;
    }
    return one_to_one(out, in, a, c10d::OpType::ALLTOALL_BASE);
  }
  WorkPtr fast_alltoall(Tensors& out, Tensors& in, const c10d::AllToAllOptions& o) {
    if (!takes_all(out) || !takes_all(in)) {
      return {};
    }
    std::vector<api::TensorArg> outs, ins;
    for (auto& x : out) {
      outs.push_back(arg(x));
    }
    for (auto& x : in) {
      ins.push_back(arg(x));
    }
    auto a = args(api::ALL_TO_ALL, o.timeout, !o.asyncOp);
    a.outs = outs.data();
    a.n_outs = outs.size();
    a.ins = ins.data();
    a.n_ins = ins.size();
    std::vector<api::OpArgs> ops{a};
    Tensors keep(out);
    keep.insert(keep.end(), in.begin(), in.end());
    return start(ops, std::move(keep), out, c10d::OpType::ALLTOALL);
  }
  // Sends and receives run in the background: torch's isend and irecv
  // must not block, and its send and recv wait on the Work.
  WorkPtr p2p(Tensors& t, uint32_t kind, int64_t peer, int tag, c10d::OpType type) {
    if (!takes_all(t)) {
      return {};
    }
    std::vector<api::TensorArg> targs;
    for (auto& x : t) {
      targs.push_back(arg(x));
    }
    std::vector<api::OpArgs> ops(t.size(), args(kind, std::chrono::milliseconds(0), false));
    for (size_t i = 0; i < t.size(); ++i) {
      ops[i].peer = peer;
      ops[i].tag = static_cast<uint32_t>(tag);
      if (kind == api::SEND) {
        ops[i].ins = &targs[i];
        ops[i].n_ins = 1;
      } else {
        ops[i].outs = &targs[i];
        ops[i].n_outs = 1;
      }
    }
    return start(ops, t, t, type);
  }
  WorkPtr fast_send(Tensors& t, int dst, int tag) {
    return tag < 0 ? WorkPtr() : p2p(t, api::SEND, dst, tag, c10d::OpType::SEND);
  }
  WorkPtr fast_recv(Tensors& t, int src, int tag) {
    return tag < 0 ? WorkPtr() : p2p(t, api::RECV, src, tag, c10d::OpType::RECV);
  }
  WorkPtr fast_recvAnysource(Tensors& t, int tag) {
    return tag < 0 ? WorkPtr() : p2p(t, api::RECV_ANY, -1, tag, c10d::OpType::RECVANYSOURCE);
  }
  WorkPtr fast_barrier(const c10d::BarrierOptions& o) {
    std::vector<api::OpArgs> ops{args(api::BARRIER, o.timeout, !o.asyncOp)};
    return start(ops, Tensors{}, Tensors{}, c10d::OpType::BARRIER);
  }

  std::shared_ptr<CompletionHooks> hooks_ = std::make_shared<CompletionHooks>();
  std::shared_ptr<AbortHooks> aborts_ = std::make_shared<AbortHooks>();
  // weft's C API and group (null until `bindNative`).
  const api::Table* api_ = nullptr;
  const api::Group* group_ = nullptr;
  std::atomic<int64_t> timeout_ms_{0};
  std::atomic<bool> coalescing_{false};
};

#undef WEFT_OP
#undef WEFT_PY_OP

}  // namespace weft_c10d

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "weft's c10d::Backend over its Python Backend (see backend.cpp)";
  // torch's Backend class must be bound before this one derives from it.
  py::module_::import("torch.distributed");
  using B = weft_c10d::Backend;
  using weft_c10d::Tensors;
  using weft_c10d::TensorLists;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<weft_c10d::Backend, c10d::Backend, c10::intrusive_ptr<weft_c10d::Backend>>(m, "Backend", "weft's c10d::Backend: subclass it in Python")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"))
      .def("_fire_abort_hooks", &weft_c10d::Backend::fireAbortHooks, py::call_guard<py::gil_scoped_release>(), "Run the abort hooks, once.")
      .def("_bind_native", &weft_c10d::Backend::bindNative, py::arg("group"), py::arg("table"), py::arg("timeout"),
           "Issue the ops weft's C API takes through it (see native.hpp).")
      .def("_set_native_timeout", &weft_c10d::Backend::setNativeTimeout, py::arg("seconds"), "The timeout of ops issued through the C API.")
      .def("_set_coalescing", &weft_c10d::Backend::setCoalescing, py::arg("on"), "Whether the group is coalescing (ops go through Python).")
      // The ops by the names and arguments torch's Python functions call a
      // group with, straight to this C++ backend (weft's own ProcessGroup
      // binds them: weft/_backend.py).
      .def("_native_allreduce", [](B& b, Tensors t, const c10d::AllreduceOptions& o) { return b.allreduce(t, o); }, nogil)
      .def("_native_broadcast", [](B& b, Tensors t, const c10d::BroadcastOptions& o) { return b.broadcast(t, o); }, nogil)
      .def("_native_reduce", [](B& b, Tensors t, const c10d::ReduceOptions& o) { return b.reduce(t, o); }, nogil)
      .def("_native_allgather", [](B& b, TensorLists out, Tensors in, const c10d::AllgatherOptions& o) { return b.allgather(out, in, o); }, nogil)
      .def("_native_all_gather_single",
           [](B& b, at::Tensor out, at::Tensor in, const c10d::AllgatherOptions& o) { return b.all_gather_single(out, in, o); }, nogil)
      .def("_native_reduce_scatter_single",
           [](B& b, at::Tensor out, at::Tensor in, const c10d::ReduceScatterOptions& o) { return b.reduce_scatter_single(out, in, o); }, nogil)
      .def("_native_all_to_all_single",
           [](B& b, at::Tensor out, at::Tensor in, std::vector<int64_t> os, std::vector<int64_t> is, const c10d::AllToAllOptions& o) {
             return b.all_to_all_single(out, in, os, is, o);
           }, nogil)
      .def("_native_alltoall", [](B& b, Tensors out, Tensors in, const c10d::AllToAllOptions& o) { return b.alltoall(out, in, o); }, nogil)
      .def("_native_send", [](B& b, Tensors t, int dst, int tag) { return b.send(t, dst, tag); }, nogil)
      .def("_native_recv", [](B& b, Tensors t, int src, int tag) { return b.recv(t, src, tag); }, nogil)
      .def("_native_recv_anysource", [](B& b, Tensors t, int tag) { return b.recvAnysource(t, tag); }, nogil)
      .def("_native_barrier", [](B& b, const c10d::BarrierOptions& o) { return b.barrier(o); }, py::arg("opts") = c10d::BarrierOptions(), nogil);
}
