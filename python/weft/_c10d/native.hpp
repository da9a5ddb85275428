// weft's ops called from C++ without Python in between: the mirror of
// weft's C API (python/src/torch_api.rs), the Work of an op issued
// through it, and the thread that finishes such Works' futures.
//
// Invariants: the tensors an op views are held by its NativeWork, and
// after the NativeWork is gone by the release callback weft calls once
// the op can no longer touch them. Callbacks from weft's threads only
// queue tasks for the completer thread: no tensor is freed and no future
// completed (both may run Python) on weft's threads.

#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/ivalue.h>

#include <cxxabi.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace weft_c10d {

namespace py = pybind11;

// -- the C API (python/src/torch_api.rs; its VERSION) ------------------------
namespace api {

constexpr uint32_t kVersion = 1;

enum Kind : uint32_t {
  ALL_REDUCE = 1,
  BROADCAST = 2,
  REDUCE = 3,
  ALL_GATHER = 4,
  ALL_GATHER_SINGLE = 5,
  REDUCE_SCATTER_SINGLE = 6,
  ALL_TO_ALL_SINGLE = 7,
  ALL_TO_ALL = 8,
  SEND = 9,
  RECV = 10,
  RECV_ANY = 11,
  BARRIER = 12,
};

struct TensorArg {
  void* ptr;
  uint64_t numel;
  uint8_t dtype;
  int32_t device;
};

struct OpArgs {
  uint32_t kind;
  uint32_t reduce;
  int64_t peer;
  uint32_t tag;
  uint8_t direct;
  int64_t timeout_ms;
  const TensorArg* outs;
  size_t n_outs;
  const TensorArg* ins;
  size_t n_ins;
  const uint64_t* out_splits;
  const uint64_t* in_splits;
  size_t n_splits;
};

struct Release {
  void (*call)(void*);
  void* ctx;
};

struct OpHandle;
struct Group;

struct Table {
  uint32_t version;
  OpHandle* (*start)(const Group*, const OpArgs*, PyObject**);
  int32_t (*wait)(const OpHandle*, int64_t, PyObject**);
  uint8_t (*is_completed)(const OpHandle*);
  uint8_t (*failed)(const OpHandle*, PyObject**);
  int64_t (*source)(const OpHandle*);
  double (*duration_ms)(const OpHandle*);
  void (*on_done)(const OpHandle*, Release);
  void (*release)(OpHandle*, Release);
  void (*group_release)(const Group*);
};

}  // namespace api

// Raise the Python exception `err` (a new reference weft made) as a C++
// exception that torch's bindings turn back into it, its type kept.
[[noreturn]] inline void raise(PyObject* err) {
  py::gil_scoped_acquire gil;
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err)), err);
  Py_DECREF(err);
  throw py::error_already_set();
}

// weft's dtype code of `t` (core/src/dtype.rs), or -1.
inline int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kHalf: return 2;
    case at::kBFloat16: return 3;
    case at::kChar: return 4;
    case at::kByte: return 5;
    case at::kInt: return 6;
    case at::kLong: return 7;
    case at::kUInt32: return 8;
    case at::kUInt64: return 9;
    case at::kBool: return 10;
    default: return -1;
  }
}

// Whether weft's C API takes `t` as it is: a dense, contiguous CPU tensor
// of a dtype weft knows. Anything else goes through weft's Python ops,
// which stage it.
inline bool takes(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && dtype_code(t) >= 0;
}

inline bool takes_all(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (!takes(t)) {
      return false;
    }
  }
  return true;
}

inline api::TensorArg arg(const at::Tensor& t) {
  return {t.data_ptr(), static_cast<uint64_t>(t.numel()), static_cast<uint8_t>(dtype_code(t)), -1};
}

// One thread per process that runs what weft's callbacks queue: freeing
// the tensors of finished ops, completing futures.
class Completer {
 public:
  static Completer& get() {
    // Never destroyed: callbacks may arrive while the process exits.
    static Completer* c = new Completer();
    return *c;
  }
  void push(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> g(mutex_);
      tasks_.push_back(std::move(task));
    }
    ready_.notify_one();
  }

 private:
  Completer() : thread_([this] { run(); }) {
    thread_.detach();
  }
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> g(mutex_);
        ready_.wait(g, [this] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      if (finalizing()) {
        // The process is ending: leave the task's tensors and futures be
        // (freeing a tensor may need the GIL, which is gone).
        new std::function<void()>(std::move(task));
        continue;
      }
      try {
        // With the GIL: a task frees tensors (torch may release their
        // Python objects) and completes futures (whose callbacks may be
        // Python). Taking it here, not inside a tensor's destructor, lets
        // Python end this thread cleanly if it is shutting down.
        py::gil_scoped_acquire gil;
        task();
        task = nullptr;
      } catch (const abi::__forced_unwind&) {
        throw;  // Python is ending this thread: let it end
      } catch (...) {
        // A future's callback that throws has its error stored by torch;
        // nothing else queued here throws.
      }
    }
  }
  static bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
  }
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  std::thread thread_;
};

// A callback for weft that runs `task` on the completer thread, once.
inline api::Release on_completer(std::function<void()> task) {
  auto* heap = new std::function<void()>(std::move(task));
  return {[](void* ctx) {
            auto* t = static_cast<std::function<void()>*>(ctx);
            Completer::get().push(std::move(*t));
            delete t;
          },
          heap};
}

// Told once per Work that finished successfully (the backend's completion
// hooks: weft/_c10d/backend.cpp).
using Finished = std::function<void(uint64_t)>;

// The Work of ops issued through weft's C API: every query answered in
// C++, the tensors held until the ops can no longer touch them.
class NativeWork : public c10d::Work {
 public:
  NativeWork(
      const api::Table* api,
      std::vector<api::OpHandle*> ops,
      std::shared_ptr<std::vector<at::Tensor>> keep,
      std::vector<at::Tensor> outputs,
      int rank,
      c10d::OpType type,
      Finished finished,
      std::optional<std::vector<std::vector<at::Tensor>>> nested = std::nullopt)
      : c10d::Work(rank, type),
        api_(api),
        ops_(std::move(ops)),
        keep_(std::move(keep)),
        outputs_(std::move(outputs)),
        nested_(std::move(nested)),
        finished_(std::move(finished)) {}

  ~NativeWork() override {
    for (auto* op : ops_) {
      if (api_->is_completed(op)) {
        // Finished: its tensors go with this Work, on this thread.
        api_->release(op, {nullptr, nullptr});
      } else {
        auto keep = keep_;
        api_->release(op, on_completer([keep]() mutable { keep.reset(); }));
      }
    }
  }

  bool isCompleted() override {
    for (auto* op : ops_) {
      if (!api_->is_completed(op)) {
        return false;
      }
    }
    if (failed(nullptr) == nullptr) {
      tell_finished();
    }
    return true;
  }

  bool isSuccess() const override {
    for (auto* op : ops_) {
      if (!api_->is_completed(op) || api_->failed(op, nullptr)) {
        return false;
      }
    }
    return true;
  }

  std::exception_ptr exception() const override {
    for (auto* op : ops_) {
      if (!api_->is_completed(op)) {
        return nullptr;
      }
    }
    PyObject* err = nullptr;
    const api::OpHandle* bad = failed(&err);
    if (bad == nullptr) {
      return nullptr;
    }
    py::gil_scoped_acquire gil;
    py::object e = py::reinterpret_steal<py::object>(err);
    return std::make_exception_ptr(c10::DistBackendError(py::str(e).cast<std::string>()));
  }

  int sourceRank() const override {
    const_cast<NativeWork*>(this)->wait(std::chrono::milliseconds(0));
    int64_t src = ops_.empty() ? -1 : api_->source(ops_[0]);
    TORCH_CHECK(src >= 0, "weft: source_rank is only known for a receive from any rank");
    return static_cast<int>(src);
  }

  std::vector<at::Tensor> result() override {
    return outputs_;
  }

  void synchronize() override {
    wait(std::chrono::milliseconds(0));
  }

  // Block until every op has finished (the GIL released), at most
  // `timeout` if given; raise the first failure.
  bool wait(std::chrono::milliseconds timeout) override {
    std::unique_ptr<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) {
      nogil = std::make_unique<py::gil_scoped_release>();
    }
    for (auto* op : ops_) {
      PyObject* err = nullptr;
      int32_t r = api_->wait(op, timeout.count(), &err);
      if (r < 0) {
        nogil.reset();
        raise(err);
      }
      if (r == 0) {
        nogil.reset();
        timed_out(timeout);
      }
    }
    tell_finished();
    return true;
  }

  void blockCurrentStream() override {
    wait(std::chrono::milliseconds(0));
  }

  float getDuration() const override {
    double most = 0;
    for (auto* op : ops_) {
      double d = api_->duration_ms(op);
      TORCH_CHECK(d >= 0, "weft: an op's duration is known once it has finished");
      most = std::max(most, d);
    }
    return static_cast<float>(most);
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> g(future_mutex_);
    if (future_) {
      return future_;
    }
    auto tensors = c10::ListType::create(c10::TensorType::get());
    future_ = c10::make_intrusive<c10::ivalue::Future>(nested_ ? c10::ListType::create(tensors) : tensors);
    // Completed on the completer thread once the last op has finished.
    auto left = std::make_shared<std::atomic<size_t>>(ops_.size());
    auto self = c10::intrusive_ptr<NativeWork>::unsafe_reclaim_from_nonowning(this);
    auto complete = [self]() { self->complete_future(); };
    if (ops_.empty()) {
      Completer::get().push(complete);
    }
    for (auto* op : ops_) {
      api_->on_done(op, on_completer([left, complete]() {
                      if (left->fetch_sub(1) == 1) {
                        complete();
                      }
                    }));
    }
    return future_;
  }

 private:
  // The first op that failed (its error in `*err` if asked), or null.
  const api::OpHandle* failed(PyObject** err) const {
    for (auto* op : ops_) {
      if (api_->failed(op, err)) {
        return op;
      }
    }
    return nullptr;
  }

  [[noreturn]] static void timed_out(std::chrono::milliseconds timeout) {
    py::gil_scoped_acquire gil;
    py::object cls = py::module_::import("weft._errors").attr("WeftTimeoutError");
    std::string msg = "weft: the op did not finish within " + std::to_string(timeout.count() / 1000.0) + " s (it keeps running)";
    PyErr_SetObject(cls.ptr(), cls(msg, "timeout").ptr());
    throw py::error_already_set();
  }

  void complete_future() {
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    {
      std::lock_guard<std::mutex> g(future_mutex_);
      fut = future_;
    }
    if (auto e = exception()) {
      fut->setError(e);
      return;
    }
    tell_finished();
    fut->markCompleted(nested_ ? c10::IValue(*nested_) : c10::IValue(outputs_));
  }

  // The ops finished successfully: tell the backend's hooks, once.
  void tell_finished() {
    if (finished_ && !told_.exchange(true)) {
      finished_(getCompletionKey());
    }
  }

  const api::Table* api_;
  std::vector<api::OpHandle*> ops_;
  std::shared_ptr<std::vector<at::Tensor>> keep_;
  std::vector<at::Tensor> outputs_;
  // The future's value where it is a list per input (all_gather's).
  std::optional<std::vector<std::vector<at::Tensor>>> nested_;
  Finished finished_;
  std::atomic<bool> told_{false};
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace weft_c10d
