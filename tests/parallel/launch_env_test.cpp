// Rank/world/local rank from every supported launcher, precedence and conflicts, the store
// address, the job token and the timeouts.
#include "parallel/launch_env.h"

#include <gtest/gtest.h>

#include <fstream>

#include "parallel/launcher.h"
#include "parallel/store.h"
#include "runtime/config.h"

namespace accel {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

TEST(LaunchEnv, NoLauncherIsASingleProcess) {
  LaunchEnv e = detect_launch_env(Environment{});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_FALSE(e.distributed());
  EXPECT_EQ(e.launcher, "");
}

TEST(LaunchEnv, OpenMpi) {
  Environment env{{"OMPI_COMM_WORLD_RANK", "5"},
                  {"OMPI_COMM_WORLD_SIZE", "16"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"},
                  {"PMIX_RANK", "5"},
                  {"OMPI_MCA_orte_num_nodes", "2"},
                  {"MASTER_ADDR", "node-a"}};
  LaunchEnv e = detect_launch_env(env);
  EXPECT_EQ(e.launcher, "Open MPI");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 16);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 8);
  EXPECT_EQ(e.num_nodes, 2);
  EXPECT_EQ(e.master_addr, "node-a");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnv, MvapichPmiSlurmTorchrun) {
  LaunchEnv mv = detect_launch_env(Environment{{"MV2_COMM_WORLD_RANK", "2"},
                                               {"MV2_COMM_WORLD_SIZE", "4"},
                                               {"MV2_COMM_WORLD_LOCAL_RANK", "2"},
                                               {"MV2_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(mv.launcher, "MVAPICH");
  EXPECT_EQ(mv.rank, 2);
  EXPECT_EQ(mv.master_addr, "127.0.0.1");  // all four on this machine

  LaunchEnv pmi = detect_launch_env(
      Environment{
          {"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}},
      "10.0.0.1", 1234);
  EXPECT_EQ(pmi.launcher, "MPICH/Hydra PMI");
  EXPECT_EQ(pmi.local_rank, 1);
  EXPECT_EQ(pmi.local_world_size, 2);
  EXPECT_EQ(pmi.master_addr, "10.0.0.1");  // from the config's main_process_ip
  EXPECT_EQ(pmi.master_port, 1234);

  LaunchEnv slurm = detect_launch_env(Environment{{"SLURM_PROCID", "7"},
                                                  {"SLURM_NTASKS", "8"},
                                                  {"SLURM_STEP_NUM_TASKS", "8"},
                                                  {"SLURM_LOCALID", "3"},
                                                  {"SLURM_NODEID", "1"},
                                                  {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                                                  {"SLURM_NNODES", "2"},
                                                  {"MASTER_ADDR", "n0"},
                                                  {"MASTER_PORT", "4242"}});
  EXPECT_EQ(slurm.launcher, "Slurm");
  EXPECT_EQ(slurm.rank, 7);
  EXPECT_EQ(slurm.world_size, 8);
  EXPECT_EQ(slurm.local_rank, 3);
  EXPECT_EQ(slurm.local_world_size, 4);
  EXPECT_EQ(slurm.master_port, 4242);

  LaunchEnv tr = detect_launch_env(Environment{{"RANK", "1"},
                                               {"WORLD_SIZE", "2"},
                                               {"LOCAL_RANK", "1"},
                                               {"LOCAL_WORLD_SIZE", "2"},
                                               {"MASTER_ADDR", "127.0.0.1"},
                                               {"MASTER_PORT", "29600"}});
  EXPECT_EQ(tr.launcher, "RANK/WORLD_SIZE");
  EXPECT_EQ(tr.rank, 1);
  EXPECT_EQ(tr.master_port, 29600);
}

TEST(LaunchEnv, PrecedenceAndConflicts) {
  // mpirun inside a Slurm allocation: Open MPI wins, Slurm's numbers are not a conflict.
  LaunchEnv e = detect_launch_env(Environment{{"OMPI_COMM_WORLD_RANK", "3"},
                                              {"OMPI_COMM_WORLD_SIZE", "4"},
                                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                                              {"SLURM_PROCID", "0"},
                                              {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(e.launcher, "Open MPI");
  EXPECT_EQ(e.rank, 3);
  // The local launcher inside a one-task Slurm step: RANK/WORLD_SIZE win.
  e = detect_launch_env(Environment{{"RANK", "2"},
                                    {"WORLD_SIZE", "4"},
                                    {"LOCAL_WORLD_SIZE", "4"},
                                    {"SLURM_PROCID", "0"},
                                    {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(e.launcher, "RANK/WORLD_SIZE");
  EXPECT_EQ(e.rank, 2);
  // Stale RANK/WORLD_SIZE under mpirun: an error that names both.
  std::string msg = error_of([] {
    detect_launch_env(Environment{{"OMPI_COMM_WORLD_RANK", "1"},
                                  {"OMPI_COMM_WORLD_SIZE", "4"},
                                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                                  {"RANK", "0"},
                                  {"WORLD_SIZE", "2"}});
  });
  EXPECT_NE(msg.find("ambiguous"), std::string::npos) << msg;
  EXPECT_NE(msg.find("OMPI_COMM_WORLD_RANK=1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("WORLD_SIZE=2"), std::string::npos) << msg;
}

TEST(LaunchEnv, MalformedValuesNameTheVariable) {
  EXPECT_NE(error_of([] {
              detect_launch_env(Environment{{"RANK", "one"}, {"WORLD_SIZE", "2"}});
            }).find("RANK='one'"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              detect_launch_env(Environment{{"RANK", "2"}, {"WORLD_SIZE", "2"}});
            }).find("RANK=2 is not below WORLD_SIZE=2"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              detect_launch_env(Environment{{"OMPI_COMM_WORLD_RANK", "0"}});
            }).find("OMPI_COMM_WORLD_SIZE is not"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              detect_launch_env(Environment{{"PMIX_RANK", "0"}});
            }).find("world size"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              detect_launch_env(Environment{{"RANK", "0"},
                                            {"WORLD_SIZE", "2"},
                                            {"LOCAL_WORLD_SIZE", "2"},
                                            {"MASTER_PORT", "70000"}});
            }).find("out of range"),
            std::string::npos);
}

TEST(LaunchEnv, MultiNodeNeedsTheStoreAddress) {
  Environment env{{"OMPI_COMM_WORLD_RANK", "0"},
                  {"OMPI_COMM_WORLD_SIZE", "16"},
                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}};
  std::string msg = error_of([&] { detect_launch_env(env); });
  EXPECT_NE(msg.find("main_process_ip"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MASTER_ADDR"), std::string::npos) << msg;
  EXPECT_EQ(detect_launch_env(env, "10.1.2.3").master_addr, "10.1.2.3");
  env["MASTER_ADDR"] = "10.9.9.9";  // the environment beats the config
  EXPECT_EQ(detect_launch_env(env, "10.1.2.3").master_addr, "10.9.9.9");
}

TEST(LaunchEnv, WorldSizeMismatchSaysBothNumbers) {
  EXPECT_NO_THROW(check_world_size(4, 4));
  std::string msg = error_of([] { check_world_size(3, 4); });
  EXPECT_NE(msg.find("started 3 processes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_processes: 4"), std::string::npos) << msg;
}

TEST(LaunchEnv, JobToken) {
  EXPECT_EQ(resolve_job_token(Environment{{"ACCEL_JOB_TOKEN", "abc"}}).token, "abc");
  JobToken a = resolve_job_token(Environment{{"OMPI_MCA_orte_precondition_transports", "k1"}});
  JobToken b = resolve_job_token(Environment{{"OMPI_MCA_orte_precondition_transports", "k2"}});
  EXPECT_NE(a.token, b.token);
  EXPECT_EQ(a.token.find("k1"), std::string::npos);  // a digest, not the key itself
  EXPECT_NE(a.source.find("Open MPI"), std::string::npos);
  std::string msg = error_of([] { resolve_job_token(Environment{{"SLURM_JOB_ID", "1"}}); });
  EXPECT_NE(msg.find("ACCEL_JOB_TOKEN"), std::string::npos) << msg;
}

TEST(LaunchEnv, Timeouts) {
  Timeouts t = timeouts_from_env(
      Environment{{"ACCEL_RENDEZVOUS_TIMEOUT", "2.5"}, {"ACCEL_COLLECTIVE_TIMEOUT", "30"}});
  EXPECT_EQ(t.rendezvous.count(), 2500);
  EXPECT_EQ(t.collective.count(), 30000);
  EXPECT_EQ(timeouts_from_env(Environment{}).collective.count(), 600000);
  EXPECT_NE(error_of([] {
              timeouts_from_env(Environment{{"ACCEL_COLLECTIVE_TIMEOUT", "-1"}});
            }).find("ACCEL_COLLECTIVE_TIMEOUT='-1'"),
            std::string::npos);
}

// Huge values overflowed the deadlines (every rank failed at once "within 1e+10 s"); tiny ones
// read "0 s". Both are refused, naming the variable and the range.
TEST(LaunchEnv, TimeoutsOutOfRangeAreRefused) {
  for (const char* v : {"1e10", "2592001", "0.0001", "0", "inf", "nan"}) {
    std::string msg = error_of([&] {
      timeouts_from_env(Environment{{"ACCEL_COLLECTIVE_TIMEOUT", v}});
    });
    EXPECT_NE(msg.find("ACCEL_COLLECTIVE_TIMEOUT='" + std::string(v) + "'"), std::string::npos)
        << msg;
  }
  std::string msg = error_of([] {
    timeouts_from_env(Environment{{"ACCEL_RENDEZVOUS_TIMEOUT", "1e10"}});
  });
  EXPECT_NE(msg.find("out of range: give from 0.1 to 2592000 seconds"), std::string::npos) << msg;
  // The ends of the range are fine.
  EXPECT_EQ(timeouts_from_env(Environment{{"ACCEL_COLLECTIVE_TIMEOUT", "0.1"}}).collective.count(),
            100);
  EXPECT_EQ(
      timeouts_from_env(Environment{{"ACCEL_COLLECTIVE_TIMEOUT", "2592000"}}).collective.count(),
      2592000000LL);
  // A long value is not echoed whole.
  msg = error_of([] {
    timeouts_from_env(Environment{{"ACCEL_COLLECTIVE_TIMEOUT", std::string(5000, '9')}});
  });
  EXPECT_LT(msg.size(), 300u) << msg;
  // The library refuses what would overflow too, and short durations read in ms, not "0 s".
  EXPECT_NE(
      error_of([] { check_timeout(Millis(kMaxTimeout.count() + 1), "x"); }).find("out of range"),
      std::string::npos);
  EXPECT_EQ(describe_duration(Millis(20)), "20 ms");
  EXPECT_EQ(describe_duration(Millis(1500)), "1.5 s");
}

TEST(LaunchEnv, DistributedTimeoutInTheConfigIsBounded) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/timeout_config.yaml";
  { std::ofstream(path) << "training: {max_steps: 1}\n"; }
  EXPECT_DOUBLE_EQ(load_config(path, {"distributed.timeout_s=0.1"}).distributed.timeout_s, 0.1);
  for (const char* v : {"1e10", "2592001", "0.01", "0"}) {
    std::string msg =
        error_of([&] { load_config(path, {"distributed.timeout_s=" + std::string(v)}); });
    EXPECT_NE(msg.find("distributed.timeout_s"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2592000"), std::string::npos) << msg;
  }
}

TEST(LaunchEnv, LocalStoreAddress) {
  StoreAddress a = local_store_address(Environment{}, "", 0);
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_EQ(a.port, 0);  // the launcher picks one
  a = local_store_address(Environment{}, "127.0.0.2", 29123);
  EXPECT_EQ(a.host, "127.0.0.2");
  EXPECT_EQ(a.port, 29123);
  EXPECT_EQ(a.port_source, "main_process_port");
  a = local_store_address(Environment{{"MASTER_ADDR", "127.0.0.3"}, {"MASTER_PORT", "29124"}},
                          "127.0.0.2", 29123);  // the environment beats the config
  EXPECT_EQ(a.host, "127.0.0.3");
  EXPECT_EQ(a.port, 29124);
  EXPECT_EQ(a.port_source, "MASTER_PORT");
}

TEST(LaunchEnv, StoreSocketFromTheLocalLauncher) {
  Environment env{
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}, {"ACCEL_STORE_FD", "7"}};
  EXPECT_EQ(detect_launch_env(env).store_listen_fd, 7);
  EXPECT_EQ(
      detect_launch_env(Environment{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}})
          .store_listen_fd,
      -1);
  env["RANK"] = "1";
  EXPECT_NE(error_of([&] { detect_launch_env(env); }).find("ACCEL_STORE_FD is set for rank 1"),
            std::string::npos);
}

TEST(LaunchEnv, CpuThreadsPerRank) {
  EXPECT_EQ(cpu_threads_per_rank(Environment{}, 2, 2), 1);
  EXPECT_EQ(cpu_threads_per_rank(Environment{}, 4, 64), 16);
  EXPECT_EQ(cpu_threads_per_rank(Environment{}, 8, 2), 1);  // at least one
  EXPECT_EQ(cpu_threads_per_rank(Environment{}, 1, 8), std::nullopt);
  EXPECT_EQ(cpu_threads_per_rank(Environment{{"OMP_NUM_THREADS", "3"}}, 2, 8), std::nullopt);
  EXPECT_GE(available_cores(), 1);
}

TEST(LaunchEnv, WhenToSpawnLocalRanks) {
  EXPECT_TRUE(should_spawn_local_ranks(1, 4, 1));
  EXPECT_FALSE(should_spawn_local_ranks(4, 4, 1));  // mpirun already started them
  EXPECT_FALSE(should_spawn_local_ranks(1, 1, 1));
  EXPECT_FALSE(should_spawn_local_ranks(1, 16, 2));  // multi-node needs a real launcher
}

}  // namespace
}  // namespace accel
