// weft's c10d::Backend: the C++ object torch dispatches to, over weft's
// Python Backend (weft/_backend.py), built against the installed torch by
// weft/_c10d/__init__.py.
//
// Why it exists: torch's Python backend trampoline (PyBackend) wraps every
// Work a Python backend returns in a holder that forwards only wait() and
// get_future(), so is_completed(), source_rank() (recv from any rank) and
// exception() are lost wherever torch builds the group around the backend
// (a mixed device spec, a shrunk group). This file is
// such a trampoline with each op's Work kept whole: `Work` below forwards
// every query to weft's Python Work, `Window` every call to weft's Python
// Window, and `Backend` every virtual to the Python object it is the C++
// half of (whose class derives from this one: weft/_backend.py).
//
// Invariants: every call into Python holds the GIL; a Python error raised
// there propagates as pybind11::error_already_set, which torch's bindings
// turn back into the Python exception (its torch.distributed type kept).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Window.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/Hooks.hpp>

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
#define WEFT_OP(cname, pyname, ...)      \
  do {                                   \
    py::gil_scoped_acquire gil;          \
    py::function f = method(pyname);     \
    if (!f) {                            \
      return c10d::Backend::cname(__VA_ARGS__); \
    }                                    \
    return wrap(f(__VA_ARGS__), hooks_); \
  } while (false)

// weft's backend: each virtual of c10d::Backend calls the Python method of
// the same meaning on the Python object this is the C++ half of.
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
    WEFT_OP(allreduce_sparse, "allreduce_sparse", t, o);
  }
  WorkPtr allreduce_coalesced(Tensors& t, const c10d::AllreduceCoalescedOptions& o) override {
    WEFT_OP(allreduce_coalesced, "allreduce_coalesced", t, o);
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
    WEFT_OP(allgather_coalesced, "allgather_coalesced", out, in, o);
  }
  WorkPtr all_gather_single_coalesced(Tensors& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    WEFT_OP(all_gather_single_coalesced, "all_gather_single_coalesced", out, in, o);
  }
  WorkPtr gather(TensorLists& out, Tensors& in, const c10d::GatherOptions& o) override {
    WEFT_OP(gather, "gather", out, in, o);
  }
  WorkPtr gather_single(at::Tensor& out, at::Tensor& in, const c10d::GatherOptions& o) override {
    WEFT_OP(gather_single, "gather_single", out, in, o);
  }
  WorkPtr scatter(Tensors& out, TensorLists& in, const c10d::ScatterOptions& o) override {
    WEFT_OP(scatter, "scatter", out, in, o);
  }
  WorkPtr reduce_scatter(Tensors& out, TensorLists& in, const c10d::ReduceScatterOptions& o) override {
    WEFT_OP(reduce_scatter, "reduce_scatter", out, in, o);
  }
  WorkPtr reduce_scatter_single(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    WEFT_OP(reduce_scatter_single, "reduce_scatter_single", out, in, o);
  }
  WorkPtr reduce_scatter_single_coalesced(Tensors& out, Tensors& in, const c10d::ReduceScatterOptions& o) override {
    WEFT_OP(reduce_scatter_single_coalesced, "reduce_scatter_single_coalesced", out, in, o);
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
    WEFT_OP(endCoalescing, "end_coalescing");
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

  std::shared_ptr<CompletionHooks> hooks_ = std::make_shared<CompletionHooks>();
  std::shared_ptr<AbortHooks> aborts_ = std::make_shared<AbortHooks>();
};

#undef WEFT_OP

}  // namespace weft_c10d

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "weft's c10d::Backend over its Python Backend (see backend.cpp)";
  // torch's Backend class must be bound before this one derives from it.
  py::module_::import("torch.distributed");
  py::class_<weft_c10d::Backend, c10d::Backend, c10::intrusive_ptr<weft_c10d::Backend>>(m, "Backend", "weft's c10d::Backend: subclass it in Python")
      .def(py::init<int, int>(), py::arg("rank"), py::arg("size"))
      .def("_fire_abort_hooks", &weft_c10d::Backend::fireAbortHooks, py::call_guard<py::gil_scoped_release>(), "Run the abort hooks, once.");
}
