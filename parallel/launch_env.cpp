#include "parallel/launch_env.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "parallel/store.h"

extern char** environ;

namespace accel {

Environment current_environment() {
  Environment env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

namespace {

const std::string* lookup(const Environment& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

int parse_int(const std::string& value, const char* name, int min_value) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || v < min_value || v > (1 << 30))
    throw std::invalid_argument("launch environment: " + std::string(name) + "='" + value +
                                "' is not " +
                                (min_value > 0 ? "a positive integer" : "a non-negative integer"));
  return static_cast<int>(v);
}

std::optional<int> get_int(const Environment& env, const char* name, int min_value) {
  const std::string* v = lookup(env, name);
  if (!v) return std::nullopt;
  return parse_int(*v, name, min_value);
}

struct Candidate {
  std::string launcher;
  const char* rank_var;
  const char* size_var;
  int rank = 0, world = 1, local_rank = 0, local_world = 0, num_nodes = 0;
};

// Slurm's "2(x3),1" -> tasks on node `node`.
std::optional<int> slurm_tasks_on_node(const std::string& spec, int node) {
  int first = 0;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string part = spec.substr(pos, end - pos);
    int count = 0, repeat = 1;
    if (std::sscanf(part.c_str(), "%d(x%d)", &count, &repeat) < 1) return std::nullopt;
    if (node < first + repeat) return count;
    first += repeat;
    pos = end + 1;
  }
  return std::nullopt;
}

void finish_candidate(Candidate& c) {
  if (c.rank >= c.world)
    throw std::invalid_argument("launch environment (" + c.launcher + "): " + c.rank_var + "=" +
                                std::to_string(c.rank) + " is not below " + c.size_var + "=" +
                                std::to_string(c.world));
  if (c.local_world <= 0) c.local_world = c.num_nodes == 1 ? c.world : 0;
  if (c.local_world > 0 && c.local_rank >= c.local_world)
    throw std::invalid_argument("launch environment (" + c.launcher + "): local rank " +
                                std::to_string(c.local_rank) + " is not below the local size " +
                                std::to_string(c.local_world));
}

std::optional<Candidate> mpi_style(const Environment& env, const char* launcher,
                                   const char* rank_var, const char* size_var,
                                   const char* local_rank_var, const char* local_size_var) {
  auto rank = get_int(env, rank_var, 0);
  if (!rank) return std::nullopt;
  auto size = get_int(env, size_var, 1);
  if (!size)
    throw std::invalid_argument("launch environment (" + std::string(launcher) + "): " + rank_var +
                                " is set but " + size_var + " is not");
  Candidate c{launcher, rank_var, size_var};
  c.rank = *rank;
  c.world = *size;
  c.local_rank = get_int(env, local_rank_var, 0).value_or(0);
  c.local_world = get_int(env, local_size_var, 1).value_or(0);
  if (c.local_world > 0 && c.local_world == c.world) c.num_nodes = 1;
  return c;
}

std::vector<Candidate> candidates(const Environment& env) {
  std::vector<Candidate> out;
  auto push = [&](std::optional<Candidate> c) {
    if (!c) return;
    finish_candidate(*c);
    out.push_back(*c);
  };
  auto ompi = mpi_style(env, "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  if (ompi) {
    if (auto nodes = get_int(env, "OMPI_MCA_orte_num_nodes", 1)) ompi->num_nodes = *nodes;
  }
  push(ompi);
  push(mpi_style(env, "MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                 "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"));
  push(mpi_style(env, "MPICH/Hydra PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                 "MPI_LOCALNRANKS"));
  auto torchrun =
      mpi_style(env, "RANK/WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  if (torchrun) {
    if (auto nodes = get_int(env, "NUM_NODES", 1)) torchrun->num_nodes = *nodes;
  }
  push(torchrun);
  // Slurm: only inside a job step (srun); SLURM_STEP_NUM_TASKS is the step's size.
  if (auto procid = get_int(env, "SLURM_PROCID", 0)) {
    const char* size_var =
        lookup(env, "SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
    if (auto ntasks = get_int(env, size_var, 1)) {
      Candidate c{"Slurm", "SLURM_PROCID", size_var};
      c.rank = *procid;
      c.world = *ntasks;
      c.local_rank = get_int(env, "SLURM_LOCALID", 0).value_or(0);
      c.num_nodes =
          get_int(env,
                  lookup(env, "SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES" : "SLURM_NNODES", 1)
              .value_or(0);
      const std::string* per_node = lookup(env, "SLURM_STEP_TASKS_PER_NODE");
      if (!per_node) per_node = lookup(env, "SLURM_TASKS_PER_NODE");
      auto node = get_int(env, "SLURM_NODEID", 0);
      if (per_node && node) c.local_world = slurm_tasks_on_node(*per_node, *node).value_or(0);
      push(c);
    }
  }
  return out;
}

std::string describe(const Candidate& c) {
  return c.launcher + " (" + c.rank_var + "=" + std::to_string(c.rank) + ", " + c.size_var + "=" +
         std::to_string(c.world) + ")";
}

// FNV-1a, 64-bit, from a chosen offset basis.
uint64_t fnv1a(const std::string& s, uint64_t basis) {
  uint64_t h = basis;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

LaunchEnv detect_launch_env(const Environment& env, const std::string& main_process_ip,
                            int main_process_port) {
  std::vector<Candidate> found = candidates(env);
  const Candidate* chosen = nullptr;
  for (auto& c : found)
    if (c.world > 1) {
      chosen = &c;
      break;
    }
  if (!chosen && !found.empty()) chosen = &found.front();

  LaunchEnv out;
  if (chosen) {
    for (auto& c : found) {
      // Slurm variables also surround mpirun or torchrun started inside an allocation.
      if (&c == chosen || c.world == 1 || c.launcher == "Slurm") continue;
      if (c.rank != chosen->rank || c.world != chosen->world)
        throw std::invalid_argument(
            "launch environment is ambiguous: " + describe(*chosen) + " but " + describe(c) +
            "; unset the stale variables of the launcher you are not using");
    }
    if (const std::string* pmix = lookup(env, "PMIX_RANK")) {
      int pr = parse_int(*pmix, "PMIX_RANK", 0);
      if (chosen->world > 1 && pr != chosen->rank && chosen->launcher != "RANK/WORLD_SIZE")
        throw std::invalid_argument("launch environment is ambiguous: " + describe(*chosen) +
                                    " but PMIX_RANK=" + *pmix);
    }
    out.rank = chosen->rank;
    out.world_size = chosen->world;
    out.local_rank = chosen->local_rank;
    out.local_world_size = chosen->local_world;
    out.num_nodes = chosen->num_nodes;
    out.launcher = chosen->launcher;
  } else if (lookup(env, "PMIX_RANK")) {
    throw std::invalid_argument(
        "launch environment: PMIX_RANK is set but no variable gives the world size; set "
        "WORLD_SIZE (and RANK, LOCAL_RANK) or launch with mpirun/srun");
  }
  if (out.local_world_size <= 0 && out.num_nodes == 1) out.local_world_size = out.world_size;

  if (const std::string* addr = lookup(env, "MASTER_ADDR"); addr && !addr->empty()) {
    out.master_addr = *addr;
  } else if (!main_process_ip.empty()) {
    out.master_addr = main_process_ip;
  } else if (out.world_size == 1 || out.local_world_size == out.world_size) {
    out.master_addr = "127.0.0.1";
  } else {
    throw std::invalid_argument(
        "launch environment: " + std::to_string(out.world_size) + " processes launched by " +
        out.launcher +
        " may span several machines, but the store address is unknown: set main_process_ip in "
        "the config (or MASTER_ADDR) to an address of the machine running rank 0");
  }
  StoreAddress given = local_store_address(env, main_process_ip, main_process_port);
  out.master_port = given.port > 0 ? given.port : 29500;
  if (const std::string* fd = lookup(env, "ACCEL_STORE_FD")) {
    if (out.rank != 0)
      throw std::invalid_argument("launch environment: ACCEL_STORE_FD is set for rank " +
                                  std::to_string(out.rank) +
                                  "; only the local launcher sets it, for rank 0: unset it");
    out.store_listen_fd = parse_int(*fd, "ACCEL_STORE_FD", 0);
  }
  return out;
}

StoreAddress local_store_address(const Environment& env, const std::string& main_process_ip,
                                 int main_process_port) {
  StoreAddress a;
  if (const std::string* addr = lookup(env, "MASTER_ADDR"); addr && !addr->empty())
    a.host = *addr;
  else
    a.host = main_process_ip.empty() ? "127.0.0.1" : main_process_ip;
  if (get_int(env, "MASTER_PORT", 0)) {
    a.port = parse_int(env.at("MASTER_PORT"), "MASTER_PORT", 1);
    a.port_source = "MASTER_PORT";
  } else if (main_process_port > 0) {
    a.port = main_process_port;
    a.port_source = "main_process_port";
  }
  if (a.port > 65535)
    throw std::invalid_argument("launch environment: store port " + std::to_string(a.port) +
                                " is out of range (" + a.port_source + ")");
  return a;
}

std::optional<int> cpu_threads_per_rank(const Environment& env, int local_ranks, int cores) {
  if (const std::string* v = lookup(env, "OMP_NUM_THREADS"); v && !v->empty()) return std::nullopt;
  if (local_ranks <= 1) return std::nullopt;
  return std::max(1, cores / local_ranks);
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

void share_cpu_cores(const LaunchEnv& launch) {
  const int cores = available_cores();
  auto threads = cpu_threads_per_rank(current_environment(), launch.local_world_size, cores);
  if (!threads) return;
#ifdef _OPENMP
  omp_set_num_threads(*threads);
#endif
  if (launch.rank == 0)
    std::fprintf(stderr,
                 "launch: %d OpenMP thread%s per rank (%d cores / %d ranks on this machine); set "
                 "OMP_NUM_THREADS to choose\n",
                 *threads, *threads == 1 ? "" : "s", cores, launch.local_world_size);
}

void check_world_size(int launched, int configured) {
  if (launched != configured)
    throw std::invalid_argument(
        "the launcher started " + std::to_string(launched) + " process" +
        (launched == 1 ? "" : "es") + " but the config says num_processes: " +
        std::to_string(configured) + "; make them equal (mpirun -np " + std::to_string(configured) +
        ", or --set num_processes=" + std::to_string(launched) + ")");
}

JobToken resolve_job_token(const Environment& env) {
  if (const std::string* t = lookup(env, "ACCEL_JOB_TOKEN"); t && !t->empty())
    return {*t, "ACCEL_JOB_TOKEN"};
  if (const std::string* k = lookup(env, "OMPI_MCA_orte_precondition_transports");
      k && !k->empty()) {
    // Open MPI draws this key at random per job and hands it to every rank. Send a digest of it,
    // not the key itself.
    char buf[40];
    std::snprintf(buf, sizeof buf, "%016llx%016llx",
                  static_cast<unsigned long long>(fnv1a(*k, 0xcbf29ce484222325ull)),
                  static_cast<unsigned long long>(fnv1a(*k, 0x84222325cbf29ce4ull)));
    return {std::string("ompi-") + buf,
            "Open MPI's per-job key (OMPI_MCA_orte_precondition_transports)"};
  }
  throw std::invalid_argument(
      "no job token: set ACCEL_JOB_TOKEN to the same random string on every rank, e.g. "
      "`export ACCEL_JOB_TOKEN=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \\n')` before "
      "srun/mpiexec (Open MPI's mpirun and the local launcher provide one themselves)");
}

namespace {
std::chrono::milliseconds seconds_var(const Environment& env, const char* name,
                                      std::chrono::milliseconds dflt) {
  const std::string* v = lookup(env, name);
  if (!v) return dflt;
  size_t used = 0;
  double s = 0;
  try {
    s = std::stod(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  // A long value is cut in the message.
  const std::string shown = v->size() > 40 ? v->substr(0, 40) + "..." : *v;
  if (used == 0 || used != v->size() || !std::isfinite(s))
    throw std::invalid_argument(std::string(name) + "='" + shown + "' is not a number of seconds");
  const double lo = kMinUserTimeout.count() / 1000.0, hi = kMaxTimeout.count() / 1000.0;
  if (!(s >= lo && s <= hi)) {
    char range[96];
    std::snprintf(range, sizeof range, "from %g to %.0f seconds (30 days)", lo, hi);
    throw std::invalid_argument(std::string(name) + "='" + shown + "' is out of range: give " +
                                range);
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(s * 1000.0)));
}
}  // namespace

Timeouts timeouts_from_env(const Environment& env, Timeouts defaults) {
  defaults.rendezvous = seconds_var(env, "ACCEL_RENDEZVOUS_TIMEOUT", defaults.rendezvous);
  defaults.collective = seconds_var(env, "ACCEL_COLLECTIVE_TIMEOUT", defaults.collective);
  return defaults;
}

}  // namespace accel
