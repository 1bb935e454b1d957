// ferroce's collectives as a c10d Backend: torch routes the CPU tensors of a group to it (so
// "cpu:ferroce,cuda:nccl" keeps NCCL for CUDA tensors, on every torch with c10d Backends), and
// every operation returns a C++ Work torch reads directly (is_completed, wait with a timeout,
// get_future, the exception, the result).
//
// Built against the installed torch by ferroce/torch.py on first import (torch's
// cpp_extension, cached per torch and source). The collectives themselves are ferroce-coll's,
// reached through the table of C functions the package's Rust extension exports
// (python/src/capi.rs, `_coll_api()`); the endpoint exchange runs in Python over torch's store
// and hands this backend a Communicator, which it takes over.
//
// Threads: each backend runs its operations one at a time on a worker thread of its own, in
// the order they were called (gloo's queue feeds two threads; ferroce-coll's communicator runs
// one collective at a time); a call checks its arguments, queues the operation and returns its
// Work. Sends and receives (isend, irecv) only start there: they stay in flight together,
// moved on whenever the queue is empty, until each completes on its own (ferroce-coll's
// start_send/start_recv/progress), as gloo's do; an operation queued after them runs once they
// are done. Futures complete on other threads (`Completer`), so their callbacks may start and wait
// for collectives of their own. The communicator is used by the
// worker alone (ferroce-coll's communicator is not shared between threads). Each queued
// operation holds the tensors it reads and writes (at::Tensor references) until it ran, so
// the addresses it hands ferroce-coll stay valid: no address passes through Python.

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ferroce {

// ---- the Rust extension's table (python/src/capi.rs, `CollApi`; same order, same types) ----

struct Comm;
struct AbortHandle;

enum Status : int { kOk = 0, kInvalid = 1, kTimeout = 2, kPeer = 3, kOther = 4 };

struct CollApi {
  uint32_t version;
  uint32_t size;
  Comm* (*take)(PyObject*, char*, size_t);
  void (*free)(Comm*);
  void (*set_timeout)(Comm*, double);
  double (*timeout)(const Comm*);
  int (*allreduce)(Comm*, void*, size_t, uint32_t, uint32_t, char*, size_t);
  int (*broadcast)(Comm*, void*, size_t, size_t, char*, size_t);
  int (*reduce)(Comm*, void*, size_t, uint32_t, uint32_t, size_t, char*, size_t);
  int (*allgather)(Comm*, const void*, size_t, void*, size_t, char*, size_t);
  int (*reduce_scatter)(
      Comm*, const void*, size_t, void*, size_t, uint32_t, uint32_t, char*, size_t);
  int (*alltoall)(Comm*, const void*, size_t, void*, size_t, char*, size_t);
  int (*sendrecv)(Comm*, const void*, size_t, size_t, void*, size_t, size_t, char*, size_t);
  int (*barrier)(Comm*, char*, size_t);
  int (*recv_any)(Comm*, void*, size_t, uint32_t, size_t*, char*, size_t);
  int (*start_send)(Comm*, const void*, size_t, size_t, uint32_t, uint64_t*, char*, size_t);
  int (*start_recv)(Comm*, void*, size_t, size_t, uint32_t, uint64_t*, char*, size_t);
  int (*progress)(Comm*, double, uint64_t*, size_t, size_t*, uint8_t*, char*, size_t);
  AbortHandle* (*abort_handle)(Comm*);
  void (*abort_raise)(const AbortHandle*);
  void (*abort_free)(AbortHandle*);
};

constexpr uint32_t kApiVersion = 3;
constexpr const char* kApiCapsule = "ferroce._ferroce.coll_api";
// A side left out of a sendrecv.
constexpr size_t kNone = SIZE_MAX;

// ---- element types and operators ---------------------------------------------------------

// The numbers capi.rs's `dtype` reads.
uint32_t dtypeCode(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return 0;
    case at::kDouble:
      return 1;
    case at::kHalf:
      return 2;
    case at::kBFloat16:
      return 3;
    case at::kInt:
      return 4;
    case at::kLong:
      return 5;
    case at::kByte:
      return 6;
    default:
      C10_THROW_ERROR(
          TypeError,
          "ferroce has no element type for torch." +
              std::string(c10::getDtypeNames(t.scalar_type()).first) +
              " (float32, float64, float16, bfloat16, int32, int64 and uint8 reduce)");
  }
}

// The numbers capi.rs's `op` reads.
uint32_t opCode(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return 0;
    case c10d::ReduceOp::PRODUCT:
      return 1;
    case c10d::ReduceOp::MIN:
      return 2;
    case c10d::ReduceOp::MAX:
      return 3;
    case c10d::ReduceOp::AVG:
      return 4;
    default:
      C10_THROW_ERROR(
          ValueError, "ferroce has no such reduction (SUM, PRODUCT, MIN, MAX and AVG)");
  }
}

void checkCpu(const at::Tensor& t) {
  if (!t.device().is_cpu()) {
    C10_THROW_ERROR(ValueError, "the ferroce backend takes CPU tensors, not " + t.device().str());
  }
  if (t.layout() != at::kStrided) {
    C10_THROW_ERROR(ValueError, "the ferroce backend takes dense (strided) tensors");
  }
}

void checkCpu(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    checkCpu(t);
  }
}

// `t` itself where contiguous, else a contiguous copy (copied back by `writeBack`).
at::Tensor contiguous(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

void writeBack(at::Tensor& t, const at::Tensor& c) {
  if (!c.is_same(t)) {
    t.copy_(c);
  }
}

// `in` contiguous and sharing no memory with `out` (cloned where it does, as in torch's
// in-place all_gather_into_tensor(out, out.chunk(size)[rank])): ferroce refuses an input that
// overlaps the output.
at::Tensor apart(const at::Tensor& in, const at::Tensor& out) {
  bool same = in.numel() > 0 && out.numel() > 0 && in.has_storage() && out.has_storage() &&
      in.storage().is_alias_of(out.storage());
  return same ? in.clone(at::MemoryFormat::Contiguous) : contiguous(in);
}

// ---- completing futures --------------------------------------------------------------------

// Where futures complete, so that their callbacks never run on the worker. A callback may
// start a collective and wait for it (torch's PowerSGD DDP hook does): on the worker it would
// wait for a job queued behind itself. It may also wait on another future this pool completes,
// so a completion that finds every thread busy gets a new thread (a handful at most in
// practice: one per level of such nesting).
class Completer {
 public:
  ~Completer() {
    {
      std::lock_guard<std::mutex> lock(st_->mutex);
      st_->stop = true;
    }
    st_->cv.notify_all();
    // Its threads may be in Python callbacks that need the GIL: waited for without it. The
    // last reference may drop in one of those callbacks: that thread is let go, not joined
    // (it holds the state it runs on, and ends by itself).
    auto join = [this] {
      for (auto& t : st_->threads) {
        if (t.get_id() == std::this_thread::get_id()) {
          t.detach();
        } else if (t.joinable()) {
          t.join();
        }
      }
    };
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      join();
    } else {
      join();
    }
  }

  void post(std::function<void()> f) {
    std::lock_guard<std::mutex> lock(st_->mutex);
    st_->queue.push_back(std::move(f));
    if (st_->idle == 0) {
      auto st = st_;
      st_->threads.emplace_back([st] { loop(st); });
    } else {
      st_->cv.notify_one();
    }
  }

  // Whether the calling thread is one of a Completer's (then a Work's wait must not wait for
  // its future: the caller may be the one to complete it).
  static bool onCompletionThread() {
    return inside_;
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> queue;
    std::vector<std::thread> threads;
    size_t idle = 0;
    bool stop = false;
  };

  static void loop(std::shared_ptr<State> st) {
    inside_ = true;
    std::unique_lock<std::mutex> lock(st->mutex);
    for (;;) {
      st->idle++;
      st->cv.wait(lock, [&] { return st->stop || !st->queue.empty(); });
      st->idle--;
      if (st->queue.empty()) {
        return; // stopped, and everything posted ran
      }
      auto f = std::move(st->queue.front());
      st->queue.pop_front();
      lock.unlock();
      f();
      lock.lock();
    }
  }

  static thread_local bool inside_;
  std::shared_ptr<State> st_ = std::make_shared<State>();
};

thread_local bool Completer::inside_ = false;

// ---- Work --------------------------------------------------------------------------------

class FerroceWork : public c10d::Work {
 public:
  FerroceWork(
      int rank,
      c10d::OpType type,
      const char* title,
      std::vector<at::Tensor> outputs,
      std::function<void()> body,
      std::shared_ptr<Completer> completer)
      : Work(rank, type, title),
        outputs_(std::move(outputs)),
        body_(std::move(body)),
        completer_(std::move(completer)),
        future_(c10::make_intrusive<at::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  // Runs the operation on the worker, then completes.
  // For a body that needs its own Work (set before the Work is queued).
  void setBody(std::function<void()> body) {
    body_ = std::move(body);
  }

  void execute() {
    // The body runs from a local: completing the Work inside it (a failed start) clears
    // `body_`, which must not destroy the running lambda and what it captured.
    auto body = std::move(body_);
    body_ = nullptr;
    std::exception_ptr error;
    try {
      body();
    } catch (...) {
      error = std::current_exception();
    }
    if (error || !deferred_) {
      complete(error);
    }
  }

  // Called by a body that only started the operation: it completes later (`complete`).
  void defer() {
    deferred_ = true;
  }

  // The Work completes here; its future on the Completer (see there), whose callbacks may
  // start collectives of their own.
  void complete(std::exception_ptr error) {
    body_ = nullptr; // the inputs it held
    finish(error);
    auto future = future_;
    auto outputs = outputs_;
    completer_->post([future, outputs, error]() {
      if (error) {
        future->setError(error);
      } else {
        future->markCompleted(c10::IValue(outputs));
      }
    });
  }

  // As gloo's: returns once the operation ran and its future completed (its callbacks ran),
  // and raises the operation's error. In a callback of a future (on the Completer) only the
  // operation is waited for: the future may be the caller's own to complete.
  bool wait(std::chrono::milliseconds timeout) override {
    bool done = Work::wait(timeout);
    if (!Completer::onCompletionThread()) {
      future_->wait();
    }
    return done;
  }

  std::vector<at::Tensor> result() override {
    return outputs_;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

  // The sender of a receive from any source, once it completed (-1 before, and for others).
  int sourceRank() const override {
    return source_.load();
  }

  void setSourceRank(int rank) {
    source_.store(rank);
  }

 private:
  std::vector<at::Tensor> outputs_;
  std::function<void()> body_;
  std::shared_ptr<Completer> completer_;
  c10::intrusive_ptr<at::ivalue::Future> future_;
  std::atomic<int> source_{-1};
  bool deferred_ = false;
};

// ---- the backend -------------------------------------------------------------------------

class ProcessGroupFerroce : public c10d::Backend {
 public:
  ProcessGroupFerroce(
      const CollApi& api,
      Comm* comm,
      int rank,
      int size,
      std::chrono::milliseconds timeout)
      : Backend(rank, size),
        table_(api),
        api_(&table_),
        comm_(comm),
        abort_(api_->abort_handle(comm)),
        timeout_(timeout) {
    const char* sync = std::getenv("FERROCE_TORCH_SYNC");
    sync_ = sync != nullptr && std::string(sync) != "" && std::string(sync) != "0";
    if (!sync_) {
      worker_ = std::thread([this] { run(); });
    }
  }

  ~ProcessGroupFerroce() override {
    stopAndFree();
    api_->abort_free(abort_);
    // The Completer's threads may be in Python callbacks that need the GIL: joined without.
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      completer_.reset();
    } else {
      completer_.reset();
    }
  }

  // destroy_process_group: what was queued runs (and what is in flight gets a last moment),
  // then the worker ends and the communicator closes its links; later calls are refused.
  void shutdown() {
    stopAndFree();
  }

  // ProcessGroup.abort(): the operation under way fails at once ("aborted"), and so do those
  // queued and in flight; the peers' operations fail at once too (ferroce-coll tells them), and
  // the communicator goes.
  void abort() {
    std::deque<Job> dropped;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      dropped.swap(queue_);
    }
    api_->abort_raise(abort_);
    cv_.notify_all();
    std::exception_ptr error;
    try {
      C10_THROW_ERROR(DistBackendError, "ferroce: the process group was aborted");
    } catch (...) {
      error = std::current_exception();
    }
    for (auto& job : dropped) {
      job.work->complete(error);
    }
    stopAndFree();
  }

  const std::string getBackendName() const override {
    return "ferroce";
  }

  // -- collectives ---------------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    if (!tensors.empty() && tensors[0].layout() == at::kSparse) {
      return allreduceSparse(tensors, opts);
    }
    checkCpu(tensors);
    uint32_t op = opCode(opts.reduceOp);
    for (const auto& t : tensors) {
      dtypeCode(t);
    }
    return enqueue(c10d::OpType::ALLREDUCE, "ferroce:all_reduce", tensors, opts.timeout,
                   [this, tensors, op]() mutable {
                     for (auto& t : tensors) {
                       allreduceOne(t, op);
                     }
                   });
  }

  // gloo's all_reduce of sparse COO tensors (DDP's sparse gradients, an
  // nn.Embedding(sparse=True)'s, say), SUM only as gloo's: every rank's indices and values go
  // to every rank, which sums them all in rank order, so each ends with the same coalesced
  // tensor, put in place of its own.
  c10::intrusive_ptr<c10d::Work> allreduceSparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) {
    for (const auto& t : tensors) {
      if (!t.device().is_cpu()) {
        C10_THROW_ERROR(ValueError,
                        "the ferroce backend takes CPU tensors, not " + t.device().str());
      }
      TORCH_CHECK_VALUE(t.layout() == at::kSparse,
                        "all_reduce: sparse and dense tensors cannot be reduced together");
      // Checked here, on the caller's thread: a sum that failed on the worker would fail this
      // rank alone, and leave the others waiting in the gathers.
      TORCH_CHECK_VALUE(t.sizes() == tensors[0].sizes() &&
                            t.scalar_type() == tensors[0].scalar_type() &&
                            t.sparse_dim() == tensors[0].sparse_dim() &&
                            t.dense_dim() == tensors[0].dense_dim(),
                        "all_reduce: sparse tensors of one call must agree in shape and dtype");
    }
    TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM,
                      "ferroce reduces sparse tensors with SUM only (as gloo does)");
    return enqueue(c10d::OpType::ALLREDUCE, "ferroce:sparse_all_reduce", tensors, opts.timeout,
                   [this, tensors]() mutable {
                     auto sum = tensors[0];
                     for (size_t i = 1; i < tensors.size(); i++) {
                       sum = sum + tensors[i];
                     }
                     auto out = sparseSum(sum.coalesce());
                     for (auto& t : tensors) {
                       t.copy_(out);
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    checkCpu(tensors);
    uint32_t op = opCode(opts.reduceOp);
    for (const auto& t : tensors) {
      TORCH_CHECK_VALUE(
          t.scalar_type() == tensors.at(0).scalar_type(),
          "all_reduce_coalesced takes tensors of one dtype");
      dtypeCode(t);
    }
    return enqueue(c10d::OpType::ALLREDUCE_COALESCED, "ferroce:all_reduce_coalesced", tensors,
                   opts.timeout, [this, tensors, op]() mutable {
                     if (tensors.empty()) {
                       return;
                     }
                     // One reduction of them all, flattened (gloo's needs one dtype too).
                     auto flat = flatten(tensors);
                     allreduceOne(flat, op);
                     unflatten(flat, tensors);
                   });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    checkCpu(tensors);
    checkRank(opts.rootRank, "root");
    TORCH_CHECK_VALUE(
        opts.rootTensor >= 0 && opts.rootTensor < static_cast<int64_t>(tensors.size()),
        "broadcast: root tensor ", opts.rootTensor, " of ", tensors.size());
    size_t root = static_cast<size_t>(opts.rootRank);
    size_t which = static_cast<size_t>(opts.rootTensor);
    return enqueue(c10d::OpType::BROADCAST, "ferroce:broadcast", tensors, opts.timeout,
                   [this, tensors, root, which]() mutable {
                     auto& t = tensors[which];
                     auto c = contiguous(t);
                     call(api_->broadcast(comm_, c.data_ptr(), c.nbytes(), root, err_, sizeof err_));
                     writeBack(t, c);
                     // Every other tensor of this rank gets it too (gloo's meaning).
                     for (size_t i = 0; i < tensors.size(); i++) {
                       if (i != which) {
                         tensors[i].copy_(t);
                       }
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    checkCpu(tensors);
    checkRank(opts.rootRank, "root");
    uint32_t op = opCode(opts.reduceOp);
    for (const auto& t : tensors) {
      dtypeCode(t);
    }
    size_t root = static_cast<size_t>(opts.rootRank);
    return enqueue(c10d::OpType::REDUCE, "ferroce:reduce", tensors, opts.timeout,
                   [this, tensors, op, root]() mutable {
                     for (auto& t : tensors) {
                       auto c = contiguous(t);
                       call(api_->reduce(comm_, c.data_ptr(), c.nbytes(), dtypeCode(c), op, root,
                                         err_, sizeof err_));
                       writeBack(t, c);
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    checkCpu(inputs);
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "all_gather: one output list per input");
    for (size_t i = 0; i < inputs.size(); i++) {
      checkCpu(outputs[i]);
      TORCH_CHECK_VALUE(
          outputs[i].size() == static_cast<size_t>(size_),
          "all_gather: ", outputs[i].size(), " output tensors for ", size_, " ranks");
      for (const auto& o : outputs[i]) {
        TORCH_CHECK_VALUE(
            o.sizes() == inputs[i].sizes() && o.scalar_type() == inputs[i].scalar_type(),
            "all_gather: an output tensor differs from the input in shape or dtype");
      }
    }
    return enqueue(c10d::OpType::ALLGATHER, "ferroce:all_gather", flat(outputs), opts.timeout,
                   [this, outputs, inputs]() mutable {
                     for (size_t i = 0; i < inputs.size(); i++) {
                       auto in = contiguous(inputs[i]);
                       std::vector<int64_t> shape{size_};
                       shape.insert(shape.end(), in.sizes().begin(), in.sizes().end());
                       auto gathered = at::empty(shape, in.options());
                       allgatherInto(in, gathered);
                       for (int64_t r = 0; r < size_; r++) {
                         outputs[i][r].copy_(gathered[r]);
                       }
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    checkCpu(output);
    checkCpu(input);
    TORCH_CHECK_VALUE(
        output.numel() == input.numel() * size_ && output.scalar_type() == input.scalar_type(),
        "all_gather_into_tensor: the output must hold ", size_, " inputs of its dtype");
    std::vector<at::Tensor> outs{output};
    return enqueue(c10d::OpType::_ALLGATHER_BASE, "ferroce:all_gather_into_tensor", outs,
                   opts.timeout, [this, output, input]() mutable {
                     auto c = contiguous(output);
                     allgatherInto(apart(input, c), c);
                     writeBack(output, c);
                   });
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    checkCpu(outputs);
    checkCpu(inputs);
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "one output per input");
    for (size_t i = 0; i < inputs.size(); i++) {
      TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * size_ &&
                            outputs[i].scalar_type() == inputs[i].scalar_type(),
                        "all_gather_into_tensor: the output must hold ", size_,
                        " inputs of its dtype");
    }
    return enqueue(c10d::OpType::COALESCED, "ferroce:all_gather_into_tensor_coalesced", outputs,
                   opts.timeout, [this, outputs, inputs]() mutable {
                     for (size_t i = 0; i < inputs.size(); i++) {
                       auto c = contiguous(outputs[i]);
                       allgatherInto(apart(inputs[i], c), c);
                       writeBack(outputs[i], c);
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    checkCpu(inputs);
    TORCH_CHECK_VALUE(outputLists.size() == static_cast<size_t>(size_),
                      "all_gather_coalesced: one output list per rank");
    for (const auto& t : inputs) {
      TORCH_CHECK_VALUE(t.scalar_type() == inputs.at(0).scalar_type(),
                        "all_gather_coalesced takes tensors of one dtype");
    }
    for (auto& outs : outputLists) {
      checkCpu(outs);
      TORCH_CHECK_VALUE(outs.size() == inputs.size(),
                        "all_gather_coalesced: each output list matches the inputs");
      for (size_t i = 0; i < outs.size(); i++) {
        TORCH_CHECK_VALUE(outs[i].numel() == inputs[i].numel(),
                          "all_gather_coalesced: an output differs from its input in size");
      }
    }
    return enqueue(c10d::OpType::ALLGATHER_COALESCED, "ferroce:all_gather_coalesced",
                   flat(outputLists), opts.timeout, [this, outputLists, inputs]() mutable {
                     if (inputs.empty()) {
                       return;
                     }
                     // Every rank's inputs flattened into one block, one allgather, then
                     // split back: outputLists[r][i] gets rank r's inputs[i].
                     auto one = flatten(inputs);
                     auto gathered = at::empty({size_, one.numel()}, one.options());
                     allgatherInto(one, gathered);
                     for (int64_t r = 0; r < size_; r++) {
                       unflatten(gathered[r], outputLists[r]);
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    checkRank(opts.rootRank, "root");
    TORCH_CHECK_VALUE(inputs.size() == 1, "gather takes one input tensor");
    checkCpu(inputs);
    int64_t root = opts.rootRank;
    if (rank_ == root) {
      TORCH_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                        "gather: the root needs one output tensor per rank");
      checkCpu(outputs[0]);
      for (const auto& o : outputs[0]) {
        TORCH_CHECK_VALUE(o.numel() == inputs[0].numel(),
                          "gather: an output differs from the input in size");
      }
    } else {
      TORCH_CHECK_VALUE(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                        "gather: only the root takes outputs");
    }
    return enqueue(c10d::OpType::GATHER, "ferroce:gather", flat(outputs), opts.timeout,
                   [this, outputs, inputs, root]() mutable {
                     auto in = contiguous(inputs[0]);
                     if (rank_ != root) {
                       sendTo(in, root);
                       return;
                     }
                     for (int64_t r = 0; r < size_; r++) {
                       auto& out = outputs[0][r];
                       if (r == rank_) {
                         out.copy_(in);
                       } else {
                         auto c = contiguous(out);
                         recvFrom(c, r);
                         writeBack(out, c);
                       }
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    checkRank(opts.rootRank, "root");
    TORCH_CHECK_VALUE(outputs.size() == 1, "scatter takes one output tensor");
    checkCpu(outputs);
    int64_t root = opts.rootRank;
    if (rank_ == root) {
      TORCH_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                        "scatter: the root needs one input tensor per rank");
      checkCpu(inputs[0]);
      for (const auto& i : inputs[0]) {
        TORCH_CHECK_VALUE(i.numel() == outputs[0].numel(),
                          "scatter: an input differs from the output in size");
      }
    } else {
      TORCH_CHECK_VALUE(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                        "scatter: only the root takes inputs");
    }
    return enqueue(c10d::OpType::SCATTER, "ferroce:scatter", outputs, opts.timeout,
                   [this, outputs, inputs, root]() mutable {
                     auto& out = outputs[0];
                     if (rank_ != root) {
                       auto c = contiguous(out);
                       recvFrom(c, root);
                       writeBack(out, c);
                       return;
                     }
                     for (int64_t r = 0; r < size_; r++) {
                       if (r == rank_) {
                         out.copy_(inputs[0][r]);
                       } else {
                         sendTo(contiguous(inputs[0][r]), r);
                       }
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    checkCpu(outputs);
    uint32_t op = opCode(opts.reduceOp);
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "reduce_scatter: one input list per output");
    for (size_t i = 0; i < outputs.size(); i++) {
      dtypeCode(outputs[i]);
      checkCpu(inputs[i]);
      TORCH_CHECK_VALUE(inputs[i].size() == static_cast<size_t>(size_),
                        "reduce_scatter: one input tensor per rank");
      for (const auto& t : inputs[i]) {
        TORCH_CHECK_VALUE(t.numel() == outputs[i].numel() &&
                              t.scalar_type() == outputs[i].scalar_type(),
                          "reduce_scatter: an input differs from the output in size or dtype");
      }
    }
    return enqueue(c10d::OpType::REDUCE_SCATTER, "ferroce:reduce_scatter", outputs, opts.timeout,
                   [this, outputs, inputs, op]() mutable {
                     for (size_t i = 0; i < outputs.size(); i++) {
                       auto whole = flatten(inputs[i]);
                       auto c = contiguous(outputs[i]);
                       reduceScatterInto(whole, c, op);
                       writeBack(outputs[i], c);
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    checkCpu(output);
    checkCpu(input);
    uint32_t op = opCode(opts.reduceOp);
    dtypeCode(output);
    TORCH_CHECK_VALUE(
        input.numel() == output.numel() * size_ && input.scalar_type() == output.scalar_type(),
        "reduce_scatter_tensor: the input must hold ", size_, " outputs of its dtype");
    std::vector<at::Tensor> outs{output};
    return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, "ferroce:reduce_scatter_tensor", outs,
                   opts.timeout, [this, output, input, op]() mutable {
                     auto c = contiguous(output);
                     reduceScatterInto(apart(input, c), c, op);
                     writeBack(output, c);
                   });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    checkCpu(outputs);
    checkCpu(inputs);
    uint32_t op = opCode(opts.reduceOp);
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "one input per output");
    for (size_t i = 0; i < outputs.size(); i++) {
      dtypeCode(outputs[i]);
      TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * size_ &&
                            inputs[i].scalar_type() == outputs[i].scalar_type(),
                        "reduce_scatter_tensor: the input must hold ", size_,
                        " outputs of its dtype");
    }
    return enqueue(c10d::OpType::COALESCED, "ferroce:reduce_scatter_tensor_coalesced", outputs,
                   opts.timeout, [this, outputs, inputs, op]() mutable {
                     for (size_t i = 0; i < outputs.size(); i++) {
                       auto c = contiguous(outputs[i]);
                       reduceScatterInto(apart(inputs[i], c), c, op);
                       writeBack(outputs[i], c);
                     }
                   });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplits,
      std::vector<int64_t>& inputSplits,
      const c10d::AllToAllOptions& opts) override {
    checkCpu(output);
    checkCpu(input);
    TORCH_CHECK_VALUE(output.scalar_type() == input.scalar_type(),
                      "all_to_all_single: input and output of one dtype");
    // Even: the whole buffers, cut into equal blocks of bytes, which are equal blocks of rows
    // (gloo's and torch's: the first dimension must divide by the group's size, checked here
    // with the uneven splits, at the call).
    bool even = outputSplits.empty() && inputSplits.empty();
    blocks(input, inputSplits, "input");
    blocks(output, outputSplits, "output");
    std::vector<at::Tensor> outs{output};
    return enqueue(c10d::OpType::ALLTOALL_BASE, "ferroce:all_to_all_single", outs, opts.timeout,
                   [this, output, input, even, inputSplits, outputSplits]() mutable {
                     auto c = contiguous(output);
                     auto in = apart(input, c);
                     if (even) {
                       call(api_->alltoall(comm_, in.data_ptr(), in.nbytes(), c.data_ptr(),
                                           c.nbytes(), err_, sizeof err_));
                     } else {
                       exchangeBlocks(blocks(in, inputSplits, "input"),
                                      blocks(c, outputSplits, "output"));
                     }
                     writeBack(output, c);
                   });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    checkCpu(outputs);
    checkCpu(inputs);
    TORCH_CHECK_VALUE(
        outputs.size() == static_cast<size_t>(size_) && inputs.size() == static_cast<size_t>(size_),
        "all_to_all: one input and one output tensor per rank");
    for (size_t i = 0; i < inputs.size(); i++) {
      TORCH_CHECK_VALUE(inputs[i].scalar_type() == inputs[0].scalar_type() &&
                            outputs[i].scalar_type() == inputs[0].scalar_type(),
                        "all_to_all: tensors of one dtype");
    }
    TORCH_CHECK_VALUE(inputs[rank_].numel() == outputs[rank_].numel(),
                      "all_to_all: this rank's own input and output blocks differ in size");
    return enqueue(c10d::OpType::ALLTOALL, "ferroce:all_to_all", outputs, opts.timeout,
                   [this, outputs, inputs]() mutable {
                     // Pairwise, any sizes the ranks agree on.
                     std::vector<at::Tensor> send, recv;
                     // An input that shares memory with an output (in place) is copied
                     // first: a later step would send what an earlier one received into it.
                     for (auto& t : inputs) {
                       bool shared = false;
                       for (auto& o : outputs) {
                         shared = shared || (t.numel() > 0 && o.numel() > 0 &&
                                             t.storage().is_alias_of(o.storage()));
                       }
                       send.push_back((shared ? t.clone(at::MemoryFormat::Contiguous)
                                              : contiguous(t)).reshape({-1}));
                     }
                     std::vector<at::Tensor> recvWhole;
                     for (auto& t : outputs) {
                       recvWhole.push_back(contiguous(t));
                       recv.push_back(recvWhole.back().view({-1}));
                     }
                     exchangeBlocks(send, recv);
                     for (size_t i = 0; i < outputs.size(); i++) {
                       writeBack(outputs[i], recvWhole[i]);
                     }
                   });
  }

  // -- point to point ------------------------------------------------------------------------

  // A tag is part of what must match (ferroce-coll's digest): a receive meets only a send of
  // its tag, and one whose peer's next send to it has another tag fails instead of taking
  // bytes meant for another receive (gloo would set that send aside for a later receive).
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override {
    checkCpu(tensors);
    checkPeer(dstRank);
    checkTag(tag);
    if (coalescing_) {
      return batched(P2p::kSend, tensors, dstRank, tag);
    }
    return startP2p(P2p::kSend, tensors, dstRank, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override {
    checkCpu(tensors);
    checkPeer(srcRank);
    checkTag(tag);
    if (coalescing_) {
      return batched(P2p::kRecv, tensors, srcRank, tag);
    }
    return startP2p(P2p::kRecv, tensors, srcRank, tag);
  }

  // The first send of the tensor's length from any rank (ferroce-coll's recv_any); the Work's
  // sourceRank() names the sender.
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override {
    checkCpu(tensors);
    checkTag(tag);
    TORCH_CHECK_VALUE(tensors.size() == 1, "recv from any source takes one tensor");
    TORCH_CHECK_VALUE(tensors[0].numel() > 0,
                      "ferroce: recv from any source of an empty tensor (an empty send carries "
                      "no message to find its sender by)");
    auto work = c10::make_intrusive<FerroceWork>(
        rank_, c10d::OpType::RECVANYSOURCE, "ferroce:recv_any_source", tensors, nullptr,
        completer_);
    FerroceWork* w = work.get();
    auto t = tensors[0];
    work->setBody([this, t, w, tag]() mutable {
      auto c = contiguous(t);
      size_t from = kNone;
      call(api_->recv_any(comm_, c.data_ptr(), c.nbytes(), static_cast<uint32_t>(tag), &from,
                          err_, sizeof err_));
      writeBack(t, c);
      w->setSourceRank(static_cast<int>(from));
    });
    return enqueueWork(work, c10d::kUnsetTimeout);
  }

  // -- coalescing (batch_isend_irecv) ------------------------------------------------------

  // torch's batch_isend_irecv issues its sends and receives between these two calls, and any
  // order of them must not deadlock (gloo's are truly asynchronous): they all start at once
  // and stay in flight together (`startBatch`).
  bool supportsCoalescing() const override {
    return true;
  }

  void startCoalescing() override {
    // A batch left open by an exception inside torch's coalescing manager is dropped (its
    // Works never ran); torch's own state for it is gone too.
    coalescing_ = true;
    batch_.clear();
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    TORCH_CHECK(coalescing_, "ferroce: endCoalescing without startCoalescing");
    coalescing_ = false;
    std::vector<P2p> ops;
    ops.swap(batch_);
    std::vector<at::Tensor> outputs;
    for (const auto& op : ops) {
      if (op.kind == P2p::kRecv) {
        outputs.push_back(op.tensor);
      }
    }
    // Queued even when empty: torch waits on this Work for what the batch's collectives
    // queued before it (its coalescing manager calls e.g. allreduce_coalesced first).
    auto work = c10::make_intrusive<FerroceWork>(rank_, c10d::OpType::COALESCED,
                                                 "ferroce:coalesced", outputs, nullptr,
                                                 completer_);
    FerroceWork* w = work.get();
    work->setBody([this, w, ops]() { startBatch(w, ops); });
    return enqueueWork(work, c10d::kUnsetTimeout, /*starts=*/true);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return enqueue(c10d::OpType::BARRIER, "ferroce:barrier", {}, opts.timeout,
                   [this]() { call(api_->barrier(comm_, err_, sizeof err_)); });
  }

  // As gloo's: rank 0 hears from every other rank within the timeout, then answers each; a
  // rank that does not arrive fails rank 0's call, naming it, and the others' with the error
  // rank 0's failure sends them. Synchronous (torch calls it for no Work), after every
  // operation queued before it.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool /* waitAllRanks */) override {
    // Unset (negative): the group's; zero: none at all (rank 0 times out at once, as gloo's).
    std::chrono::milliseconds timeout;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      timeout = opts.timeout.count() >= 0 ? opts.timeout : timeout_;
    }
    auto work = enqueue(c10d::OpType::BARRIER, "ferroce:monitored_barrier", {}, timeout,
                        [this, timeout]() { monitoredBarrierNow(timeout); });
    if (PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      work->wait();
    } else {
      work->wait();
    }
  }

  // A count of the operations called, as gloo keeps one (torch checks groups agree on it).
  void setSequenceNumberForGroup() override {
    seq_ = 0;
  }

  uint64_t getSequenceNumberForGroup() override {
    return seq_;
  }

  // -- split_group -------------------------------------------------------------------------

  // torch's split_group: a new backend for the members of `ranks` (in that order), connected
  // over the child's store (a prefix of the parent's) the way the first was, by ferroce.torch
  // in Python; nullptr for a rank outside them. Not marked `override`: torch releases without
  // splitting (and without getBackendOptions) still build this class, and those that have
  // them call these.
  bool supportsSplitting() const {
    return true;
  }

  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) {
    auto me = std::find(ranks.begin(), ranks.end(), rank_);
    if (me == ranks.end()) {
      return nullptr;
    }
    std::chrono::milliseconds timeout;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      timeout = opts ? opts->timeout : timeout_;
    }
    pybind11::gil_scoped_acquire gil;
    auto made = pybind11::module_::import("ferroce.torch")
                    .attr("_create_split")(store, static_cast<int>(me - ranks.begin()),
                                           static_cast<int>(ranks.size()),
                                           std::chrono::duration<double>(timeout).count());
    return made.cast<c10::intrusive_ptr<c10d::Backend>>();
  }

  // What split_group copies for a child when it names no options: the group's timeout.
  c10::intrusive_ptr<Options> getBackendOptions() {
    std::lock_guard<std::mutex> lock(mutex_);
    return c10::make_intrusive<Options>("ferroce", timeout_);
  }

  void setTimeout(std::chrono::milliseconds timeout) override {
    // Read by the worker at each operation (under the queue's lock).
    std::lock_guard<std::mutex> lock(mutex_);
    timeout_ = timeout;
  }

 private:
  // -- the worker ----------------------------------------------------------------------------

  struct Job {
    c10::intrusive_ptr<FerroceWork> work;
    std::chrono::milliseconds timeout;
    // Whether it only starts sends or receives (it need not wait for those in flight).
    bool starts = false;
  };

  c10::intrusive_ptr<c10d::Work> enqueue(
      c10d::OpType type,
      const char* title,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds timeout,
      std::function<void()> body) {
    auto work =
        c10::make_intrusive<FerroceWork>(rank_, type, title, std::move(outputs), std::move(body),
                                         completer_);
    return enqueueWork(work, timeout);
  }

  c10::intrusive_ptr<c10d::Work> enqueueWork(
      const c10::intrusive_ptr<FerroceWork>& work,
      std::chrono::milliseconds timeout,
      bool starts = false) {
    seq_++;
    if (sync_) {
      // FERROCE_TORCH_SYNC=1: in the caller, for comparison.
      {
        std::lock_guard<std::mutex> lock(mutex_);
        TORCH_CHECK(!stop_, "ferroce: the process group is shut down");
      }
      runJob(Job{work, timeout, starts});
      return work;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!stop_, "ferroce: the process group is shut down");
      queue_.push_back(Job{work, timeout, starts});
    }
    cv_.notify_one();
    return work;
  }

  void run() {
    // Copies into callers' tensors (a receive's write-back) are no autograd history.
    at::NoGradGuard noGrad;
    for (;;) {
      Job job;
      bool have = false, stopping = false;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (inFlight_.empty()) {
          cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        }
        if (!queue_.empty()) {
          job = std::move(queue_.front());
          queue_.pop_front();
          have = true;
        } else if (inFlight_.empty()) {
          return; // stopped, and everything queued ran
        }
        stopping = stop_;
      }
      if (!have) {
        // Nothing queued: the sends and receives in flight move on. A backend going away
        // gives them a last moment, then fails what is left.
        if (stopping) {
          auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
          while (!inFlight_.empty() && std::chrono::steady_clock::now() < until) {
            progressInFlight(0.01);
          }
          if (!inFlight_.empty()) {
            // Ended in ferroce-coll first (the peers told, the QPs stopped), so that no
            // request reads or writes the bytes this backend is about to let go.
            api_->abort_raise(abort_);
            progressInFlight(0.0);
          }
          try {
            C10_THROW_ERROR(DistBackendError,
                            "ferroce: the process group was destroyed with the send or "
                            "receive in flight");
          } catch (...) {
            failInFlight(std::current_exception());
          }
          continue;
        }
        // Spinning while a peer is slow to post its side would take a core from the
        // training thread (gloo's waiting thread sleeps): after 2 ms without a completion, one
        // turn at a time with sleeps between, which a new operation cuts short (bytes moving
        // count as progress: a long transfer keeps the fast loop).
        auto idle = std::chrono::steady_clock::now() - lastProgress_;
        if (idle < std::chrono::milliseconds(2)) {
          progressInFlight(0.001);
        } else {
          progressInFlight(0.0);
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait_for(
              lock,
              idle < std::chrono::milliseconds(100) ? std::chrono::microseconds(50)
                                                      : std::chrono::microseconds(1000),
              [this] { return stop_ || !queue_.empty(); });
        }
        continue;
      }
      if (job.starts) {
        lastProgress_ = std::chrono::steady_clock::now();
      }
      if (!job.starts) {
        // Whatever was started before the operation finishes first (ferroce-coll would
        // finish it too, but its Works complete here, now).
        while (!inFlight_.empty()) {
          progressInFlight(0.01);
        }
      }
      runJob(job);
    }
  }

  // -- sends and receives in flight (started on the worker) --------------------------------

  // A send or receive of one tensor, and the Work its caller got.
  struct P2p {
    enum Kind { kSend, kRecv } kind;
    at::Tensor tensor;
    int64_t peer;
    int tag;
    c10::intrusive_ptr<FerroceWork> work;
  };

  // One tensor's send or receive in flight: the Works it is part of (its own, and a batch's),
  // the bytes ferroce reads or writes, and for a receive into a non-contiguous tensor, that
  // tensor (written back at completion).
  struct Started {
    std::vector<c10::intrusive_ptr<FerroceWork>> works;
    at::Tensor bytes;
    at::Tensor target;
  };

  // Queues the start of a send or receive of each tensor; the Work completes when all have.
  c10::intrusive_ptr<c10d::Work> startP2p(
      P2p::Kind kind,
      const std::vector<at::Tensor>& tensors,
      int peer,
      int tag) {
    auto work = p2pWork(kind, tensors);
    FerroceWork* w = work.get();
    work->setBody([this, w, kind, tensors, peer, tag]() {
      w->defer();
      std::vector<c10::intrusive_ptr<FerroceWork>> works{
          c10::intrusive_ptr<FerroceWork>::reclaim_copy(w)};
      for (const auto& t : tensors) {
        if (start(kind, t, peer, tag, works)) {
          return;
        }
      }
      completeIfDone(w);
    });
    return enqueueWork(work, c10d::kUnsetTimeout, /*starts=*/true);
  }

  c10::intrusive_ptr<FerroceWork> p2pWork(P2p::Kind kind, const std::vector<at::Tensor>& tensors) {
    return c10::make_intrusive<FerroceWork>(
        rank_, kind == P2p::kSend ? c10d::OpType::SEND : c10d::OpType::RECV,
        kind == P2p::kSend ? "ferroce:send" : "ferroce:recv",
        kind == P2p::kRecv ? tensors : std::vector<at::Tensor>{}, nullptr, completer_);
  }

  // Starts one tensor's send or receive as a part of each of `works`; the error (and those
  // Works failed with it) if ferroce-coll refused it. Parts started before stay in flight
  // (their bytes held) until they end.
  std::exception_ptr start(P2p::Kind kind, const at::Tensor& t, int64_t peer, int tag,
                           const std::vector<c10::intrusive_ptr<FerroceWork>>& works) {
    auto c = contiguous(t);
    uint64_t ticket = 0;
    int st = kind == P2p::kSend
        ? api_->start_send(comm_, c.data_ptr(), c.nbytes(), static_cast<size_t>(peer),
                           static_cast<uint32_t>(tag), &ticket, err_, sizeof err_)
        : api_->start_recv(comm_, c.data_ptr(), c.nbytes(), static_cast<size_t>(peer),
                           static_cast<uint32_t>(tag), &ticket, err_, sizeof err_);
    if (st != kOk) {
      std::exception_ptr error;
      try {
        call(st);
      } catch (...) {
        error = std::current_exception();
      }
      for (const auto& w : works) {
        failWork(w.get(), error);
      }
      return error;
    }
    for (const auto& w : works) {
      partsLeft_[w.get()]++;
    }
    inFlight_[ticket] = Started{works, c, kind == P2p::kRecv && !c.is_same(t) ? t : at::Tensor()};
    return nullptr;
  }

  // Completes a Work none of whose parts is in flight (it had none, or they all ended).
  void completeIfDone(FerroceWork* w) {
    if (partsLeft_.count(w) == 0 && !w->isCompleted()) {
      w->complete(nullptr);
    }
  }

  // -- batches (batch_isend_irecv) -----------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> batched(
      P2p::Kind kind,
      const std::vector<at::Tensor>& tensors,
      int peer,
      int tag) {
    auto work = p2pWork(kind, tensors);
    for (const auto& t : tensors) {
      batch_.push_back(P2p{kind, t, peer, tag, work});
    }
    if (tensors.empty()) {
      batch_.push_back(P2p{kind, at::Tensor(), peer, tag, work});
    }
    return work;
  }

  // Starts every send and receive of a batch at once, each a part of its own Work and of the
  // batch's: in flight together, they cannot deadlock whatever order each rank listed them in.
  // Sends (or receives) to one peer keep their order, as torch requires.
  // A refused start fails the batch and the operations not started yet, with its error.
  void startBatch(FerroceWork* batch, const std::vector<P2p>& ops) {
    batch->defer();
    auto whole = c10::intrusive_ptr<FerroceWork>::reclaim_copy(batch);
    std::exception_ptr error;
    for (const auto& op : ops) {
      if (error) {
        failWork(op.work.get(), error);
      } else if (op.tensor.defined()) {
        error = start(op.kind, op.tensor, op.peer, op.tag, {op.work, whole});
      }
    }
    for (const auto& op : ops) {
      completeIfDone(op.work.get());
    }
    completeIfDone(batch);
  }

  // Moves what is in flight on for up to `waitSeconds`, completing the Works whose parts all
  // completed; a failure (the communicator is then broken) fails every Work in flight.
  void progressInFlight(double waitSeconds) {
    uint64_t done[64];
    size_t n = 0;
    uint8_t moved = 0;
    int st = api_->progress(comm_, waitSeconds, done, 64, &n, &moved, err_, sizeof err_);
    if (n > 0 || moved) {
      lastProgress_ = std::chrono::steady_clock::now();
    }
    for (size_t i = 0; i < n; i++) {
      auto it = inFlight_.find(done[i]);
      if (it == inFlight_.end()) {
        continue;
      }
      Started s = std::move(it->second);
      inFlight_.erase(it);
      std::exception_ptr error;
      if (s.target.defined()) {
        try {
          writeBack(s.target, s.bytes);
        } catch (...) {
          error = std::current_exception();
        }
      }
      for (const auto& work : s.works) {
        FerroceWork* w = work.get();
        if (error) {
          failWork(w, error);
        }
        if (--partsLeft_[w] == 0) {
          partsLeft_.erase(w);
          completeIfDone(w);
        }
      }
    }
    if (st != kOk) {
      try {
        call(st);
      } catch (...) {
        failInFlight(std::current_exception());
      }
    }
  }

  // Fails a Work now (once); parts of it still in flight end later without it.
  void failWork(FerroceWork* w, std::exception_ptr error) {
    if (!w->isCompleted()) {
      w->complete(error);
    }
  }

  // Fails every Work in flight and forgets them (ferroce-coll ended their operations).
  void failInFlight(std::exception_ptr error) {
    for (auto& [ticket, s] : inFlight_) {
      for (const auto& w : s.works) {
        failWork(w.get(), error);
      }
    }
    inFlight_.clear();
    partsLeft_.clear();
  }

  void runJob(const Job& job) {
    // Copies into a caller's tensors (views of leaves that require grad) are no autograd
    // history: grad mode is per thread and on by default.
    at::NoGradGuard noGrad;
    // FERROCE_TORCH_SYNC=1 runs jobs on callers' threads: one at a time still.
    std::unique_lock<std::mutex> one(syncMutex_, std::defer_lock);
    if (sync_) {
      one.lock();
    }
    std::chrono::milliseconds group;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      group = timeout_;
    }
    // The call's timeout where it names one, else the group's.
    auto t = job.timeout.count() > 0 ? job.timeout : group;
    if (t.count() > 0) {
      api_->set_timeout(comm_, std::chrono::duration<double>(t).count());
    }
    job.work->execute();
    if (sync_) {
      // No worker to move sends and receives on: the caller runs them to their end here,
      // each call on its own (so a receive posted before its peer's send waits in the call).
      while (!inFlight_.empty()) {
        progressInFlight(0.01);
      }
    }
  }

  // -- calls into ferroce-coll (worker only) ---------------------------------------------

  // Throws the error a call reported.
  void call(int status) {
    if (status == kOk) {
      return;
    }
    std::string msg = std::string("ferroce: ") + err_;
    switch (status) {
      case kInvalid:
        C10_THROW_ERROR(ValueError, msg);
      case kTimeout:
        // torch's tests (and users' handlers) look for " Timed out " in the message, as
        // gloo's timeouts say.
        C10_THROW_ERROR(DistBackendError, std::string("ferroce: Timed out (") + err_ + ")");
      case kPeer:
        C10_THROW_ERROR(DistBackendError, msg);
      default:
        C10_THROW_ERROR(DistError, msg);
    }
  }

  void allreduceOne(at::Tensor& t, uint32_t op) {
    auto c = contiguous(t);
    call(api_->allreduce(comm_, c.data_ptr(), c.nbytes(), dtypeCode(c), op, err_, sizeof err_));
    writeBack(t, c);
  }

  // The sum over ranks of each rank's coalesced sparse `mine`, coalesced. The ranks first
  // compare what they hold (dimensions, dtype, shape), so that a mismatch fails every rank
  // alike instead of gathering blocks of different lengths; then each rank's indices and
  // values, padded to the largest count, go to all.
  at::Tensor sparseSum(const at::Tensor& mine) {
    auto i64 = at::TensorOptions().dtype(at::kLong);
    int64_t nnz = mine._nnz();
    auto head = at::tensor({mine.dim(), mine.sparse_dim(), mine.dense_dim(),
                            static_cast<int64_t>(mine.scalar_type()), nnz}, i64);
    auto heads = at::empty({size_, head.numel()}, i64);
    allgatherInto(head, heads);
    auto alike = [&](const at::Tensor& rows, int64_t cols) {
      return rows.narrow(1, 0, cols).eq(rows[rank_].narrow(0, 0, cols)).all().item<bool>();
    };
    TORCH_CHECK_VALUE(alike(heads, 4),
                      "all_reduce: the ranks' sparse tensors differ in dimensions or dtype");
    auto shape = at::tensor(mine.sizes(), i64);
    auto shapes = at::empty({size_, shape.numel()}, i64);
    if (shape.numel() > 0) {
      allgatherInto(shape, shapes);
    }
    TORCH_CHECK_VALUE(alike(shapes, shape.numel()),
                      "all_reduce: the ranks' sparse tensors differ in shape");
    auto counts = heads.select(1, 4);
    int64_t most = counts.max().item<int64_t>();
    // A coalesced tensor has at most one entry per index: a count beyond that (a lying or
    // broken peer) fails every rank alike, before anything is sized by it.
    double places = 1;
    for (int64_t d = 0; d < mine.sparse_dim(); d++) {
      places *= static_cast<double>(mine.size(d));
    }
    TORCH_CHECK_VALUE(counts.min().item<int64_t>() >= 0 && static_cast<double>(most) <= places,
                      "all_reduce: a rank's sparse tensor claims more entries than its shape holds");
    if (most == 0) {
      return mine.clone();
    }
    auto indices = at::zeros({mine.sparse_dim(), most}, i64);
    indices.narrow(1, 0, nnz).copy_(mine._indices());
    std::vector<int64_t> valueShape{most};
    auto valueSizes = mine._values().sizes();
    valueShape.insert(valueShape.end(), valueSizes.begin() + 1, valueSizes.end());
    auto values = at::zeros(valueShape, mine._values().options());
    values.narrow(0, 0, nnz).copy_(mine._values());
    std::vector<int64_t> gatheredShape{size_};
    gatheredShape.insert(gatheredShape.end(), valueShape.begin(), valueShape.end());
    auto allIndices = at::empty({size_, mine.sparse_dim(), most}, i64);
    auto allValues = at::empty(gatheredShape, values.options());
    allgatherInto(indices, allIndices);
    allgatherInto(values, allValues);
    // Summed in gloo's order: rank by rank, then coalesced.
    at::Tensor sum;
    for (int64_t r = 0; r < size_; r++) {
      int64_t n = counts[r].item<int64_t>();
      TORCH_CHECK(n >= 0 && n <= most, "ferroce: a rank sent a bad sparse count");
      auto idx = allIndices[r].narrow(1, 0, n);
      auto val = allValues[r].narrow(0, 0, n);
      // A peer's indices are checked against the shape before they are used.
      at::_validate_sparse_coo_tensor_args(idx, val, mine.sizes());
      auto part = at::sparse_coo_tensor(idx, val, mine.sizes(), mine.options());
      sum = r == 0 ? part : sum + part;
    }
    return sum.coalesce();
  }

  void allgatherInto(const at::Tensor& in, at::Tensor& out) {
    call(api_->allgather(comm_, in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes(), err_,
                         sizeof err_));
  }

  void reduceScatterInto(const at::Tensor& in, at::Tensor& out, uint32_t op) {
    call(api_->reduce_scatter(comm_, in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes(),
                              dtypeCode(out), op, err_, sizeof err_));
  }

  void sendTo(const at::Tensor& t, int64_t peer) {
    call(api_->sendrecv(comm_, t.data_ptr(), t.nbytes(), static_cast<size_t>(peer), nullptr, 0,
                        kNone, err_, sizeof err_));
  }

  void recvFrom(at::Tensor& t, int64_t peer) {
    call(api_->sendrecv(comm_, nullptr, 0, kNone, t.data_ptr(), t.nbytes(),
                        static_cast<size_t>(peer), err_, sizeof err_));
  }

  // Block j of `send` to rank j, block i of `recv` from rank i (contiguous, any sizes the
  // ranks agree on): pairwise, rank r sending to r + s while receiving from r - s at step s,
  // which cannot deadlock. Empty blocks are skipped on both sides alike.
  void exchangeBlocks(const std::vector<at::Tensor>& send, const std::vector<at::Tensor>& recv) {
    int64_t n = size_, r = rank_;
    auto mine = recv[r];
    mine.copy_(send[r]);
    for (int64_t step = 1; step < n; step++) {
      int64_t to = (r + step) % n, from = (r - step + n) % n;
      const auto& out = send[to];
      auto into = recv[from];
      bool s = out.numel() > 0, g = into.numel() > 0;
      if (!s && !g) {
        continue;
      }
      call(api_->sendrecv(comm_, s ? out.data_ptr() : nullptr, s ? out.nbytes() : 0,
                          s ? static_cast<size_t>(to) : kNone, g ? into.data_ptr() : nullptr,
                          g ? into.nbytes() : 0, g ? static_cast<size_t>(from) : kNone, err_,
                          sizeof err_));
    }
  }

  void monitoredBarrierNow(std::chrono::milliseconds timeout) {
    auto one = at::zeros({1}, at::kByte);
    std::string ms = std::to_string(timeout.count()) + " ms";
    auto deadline = std::chrono::steady_clock::now() + timeout;
    if (rank_ != 0) {
      sendTo(one, 0);
      try {
        recvFrom(one, 0);
      } catch (const std::exception& e) {
        C10_THROW_ERROR(
            DistBackendError,
            "Rank " + std::to_string(rank_) +
                " successfully reached monitoredBarrier, but received errors while waiting for "
                "send/recv from rank 0: " + e.what());
      }
      return;
    }
    for (int64_t r = 1; r < size_; r++) {
      // What is left of the call's time bounds each rank's turn, as in gloo's.
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        // As when a receive times out: the communicator breaks here and now, which tells the
        // ranks waiting for rank 0's answer (their calls fail at once, not at their timeout).
        api_->abort_raise(abort_);
        progressInFlight(0.0);
        C10_THROW_ERROR(
            DistBackendError,
            "Rank 0 timed out in monitoredBarrier after " + ms + " (rank " +
                std::to_string(r) + " not heard from yet)");
      }
      api_->set_timeout(comm_, std::chrono::duration<double>(left).count());
      try {
        recvFrom(one, r);
      } catch (const std::exception& e) {
        // The communicator is broken after a failure (see ferroce-coll), so the ranks after
        // this one cannot be told apart: the first is named.
        C10_THROW_ERROR(
            DistBackendError,
            "Rank " + std::to_string(r) + " failed to pass monitoredBarrier in " + ms + ": " +
                e.what());
      }
    }
    for (int64_t r = 1; r < size_; r++) {
      sendTo(one, r);
    }
  }

  // -- argument helpers (caller thread) ------------------------------------------------------

  void checkRank(int64_t r, const char* what) const {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "ferroce: ", what, " rank ", r, " of ", size_);
  }

  static void checkTag(int tag) {
    TORCH_CHECK_VALUE(tag >= 0, "ferroce: tag ", tag, " (tags are not negative)");
  }

  void checkPeer(int r) const {
    checkRank(r, "peer");
    TORCH_CHECK_VALUE(r != rank_, "ferroce: rank ", r, " cannot send to or receive from itself");
  }

  static std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<at::Tensor> all;
    for (const auto& l : lists) {
      all.insert(all.end(), l.begin(), l.end());
    }
    return all;
  }

  static at::Tensor flatten(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> flats;
    for (const auto& t : ts) {
      flats.push_back(t.reshape({-1}));
    }
    return at::cat(flats);
  }

  static void unflatten(const at::Tensor& flat, std::vector<at::Tensor>& ts) {
    int64_t at = 0;
    for (auto& t : ts) {
      int64_t n = t.numel();
      t.copy_(flat.slice(0, at, at + n).view(t.sizes()));
      at += n;
    }
  }

  // The blocks of `t` (rows, as torch's split sizes count them) for each rank, as 1-D views.
  std::vector<at::Tensor> blocks(const at::Tensor& t, const std::vector<int64_t>& splits,
                                 const char* what) const {
    auto whole = t.reshape({-1});
    int64_t rows = t.dim() > 0 ? t.size(0) : 1;
    int64_t perRow = rows > 0 ? whole.numel() / rows : 0;
    std::vector<int64_t> s = splits;
    if (s.empty()) {
      TORCH_CHECK_VALUE(rows % size_ == 0, "all_to_all_single: ", rows, " rows of the ", what,
                        " do not split into ", size_, " equal blocks");
      s.assign(size_, rows / size_);
    }
    int64_t sum = 0;
    for (auto k : s) {
      TORCH_CHECK_VALUE(k >= 0, "all_to_all_single: a negative split size");
      sum += k;
    }
    TORCH_CHECK_VALUE(static_cast<int64_t>(s.size()) == size_ && sum == rows,
                      "all_to_all_single: the ", what, "'s split sizes do not cover its ", rows,
                      " rows in ", size_, " blocks");
    std::vector<at::Tensor> out;
    int64_t at = 0;
    for (auto k : s) {
      out.push_back(whole.slice(0, at * perRow, (at + k) * perRow));
      at += k;
    }
    return out;
  }

  // Stops the worker after what is queued (the caller may be it: then it is let go, not
  // joined) and frees the communicator, once. The worker may be in a call that takes seconds,
  // and the Completer's threads in Python callbacks that need the GIL: both are waited for
  // without it.
  void stopAndFree() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      if (freed_) {
        return;
      }
      freed_ = true;
    }
    cv_.notify_all();
    auto drain = [this] {
      if (worker_.joinable()) {
        if (worker_.get_id() == std::this_thread::get_id()) {
          worker_.detach();
        } else {
          worker_.join();
        }
      }
      // FERROCE_TORCH_SYNC=1: a caller may be in an operation (an abort raised first ends it
      // soon); the communicator goes once it is out.
      std::unique_lock<std::mutex> one(syncMutex_, std::defer_lock);
      if (sync_) {
        one.lock();
      }
      api_->free(comm_);
      comm_ = nullptr;
    };
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release release;
      drain();
    } else {
      drain();
    }
  }

  // A copy of the table: the capsule that held it is gone once the constructor returns.
  CollApi table_;
  const CollApi* api_;
  Comm* comm_;
  AbortHandle* abort_;
  bool freed_ = false; // under mutex_
  std::shared_ptr<Completer> completer_ = std::make_shared<Completer>();
  std::mutex syncMutex_; // FERROCE_TORCH_SYNC=1 only
  std::chrono::milliseconds timeout_;
  bool sync_ = false;
  // The last error's message (worker only).
  char err_[1024] = {0};

  // Between startCoalescing and endCoalescing (caller thread): the sends and receives held.
  bool coalescing_ = false;
  std::vector<P2p> batch_;
  std::atomic<uint64_t> seq_{0};

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::thread worker_;

  // Sends and receives in flight by ticket, and how many parts each Work still waits for
  // (worker only; `inFlight_.empty()` is also read under `mutex_` by the worker itself).
  std::unordered_map<uint64_t, Started> inFlight_;
  std::unordered_map<FerroceWork*, size_t> partsLeft_;
  // When something last moved or completed, or was started (how long the worker has waited
  // for the peers).
  std::chrono::steady_clock::time_point lastProgress_;
};

// Makes the backend from the Communicator Python connected (which it takes over) and the
// Rust extension's capsule of functions.
c10::intrusive_ptr<c10d::Backend> createBackend(
    pybind11::object communicator,
    pybind11::object capsule,
    int rank,
    int size,
    double timeoutSeconds) {
  auto* api = static_cast<const CollApi*>(PyCapsule_GetPointer(capsule.ptr(), kApiCapsule));
  if (api == nullptr) {
    throw pybind11::error_already_set();
  }
  TORCH_CHECK(
      api->version == kApiVersion && api->size == sizeof(CollApi),
      "ferroce: the torch backend and the _ferroce extension come from different builds "
      "(reinstall the package)");
  char err[512] = {0};
  Comm* comm = api->take(communicator.ptr(), err, sizeof err);
  TORCH_CHECK(comm != nullptr, "ferroce: ", err);
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeoutSeconds * 1000.0));
  return c10::make_intrusive<ProcessGroupFerroce>(*api, comm, rank, size, timeout);
}

} // namespace ferroce

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ferroce's c10d Backend (built by ferroce.torch against the installed torch)";
  // Registered as a subclass of torch's Backend, so the objects torch hands out are of this
  // type (pybind11 finds the most derived registered type).
  pybind11::class_<
      ferroce::ProcessGroupFerroce,
      c10d::Backend,
      c10::intrusive_ptr<ferroce::ProcessGroupFerroce>>(m, "ProcessGroupFerroce");
  m.def("create_backend", &ferroce::createBackend, pybind11::arg("communicator"),
        pybind11::arg("api"), pybind11::arg("rank"), pybind11::arg("size"),
        pybind11::arg("timeout_seconds"));
}
