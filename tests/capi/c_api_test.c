/* The C API from a C program (C11): each case is a function run by name (ctest runs each on its
 * own: `strata_c_api_test <case>`). The runtime's device tier is the host-emulated one (no GPU
 * needed); NVMe is a fresh folder under /tmp. */
#define _XOPEN_SOURCE 700
#include "strata/c_api.h"

#include <errno.h>
#include <ftw.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int failures = 0;

#define EXPECT(cond)                                                                      \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "%s:%d: expected %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              strata_last_error_message());                                               \
      ++failures;                                                                         \
    }                                                                                     \
  } while (0)

#define EXPECT_CODE(call, code)                                                                    \
  do {                                                                                             \
    int got_ = (call);                                                                             \
    if (got_ != (code)) {                                                                          \
      fprintf(stderr, "%s:%d: %s gave %s, expected %s (last error: %s)\n", __FILE__, __LINE__,     \
              #call, strata_code_name(got_), strata_code_name(code), strata_last_error_message()); \
      ++failures;                                                                                  \
    }                                                                                              \
  } while (0)

#define EXPECT_MESSAGE_HAS(text)                                                            \
  do {                                                                                      \
    if (strstr(strata_last_error_message(), (text)) == NULL) {                              \
      fprintf(stderr, "%s:%d: last error \"%s\" does not say \"%s\"\n", __FILE__, __LINE__, \
              strata_last_error_message(), (text));                                         \
      ++failures;                                                                           \
    }                                                                                       \
  } while (0)

enum { kBytes = 65536 };

static char scratch[256];

static int RemoveOne(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
  (void)st;
  (void)flag;
  (void)ftw;
  return remove(path);
}

static void MakeScratch(void) {
  const char* tmp = getenv("TMPDIR");
  snprintf(scratch, sizeof(scratch), "%s/strata-capi-XXXXXX", tmp != NULL ? tmp : "/tmp");
  if (mkdtemp(scratch) == NULL) {
    perror("mkdtemp");
    exit(2);
  }
}

static void RemoveScratch(void) { nftw(scratch, RemoveOne, 16, FTW_DEPTH | FTW_PHYS); }

/* A config with an emulated device of two partitions, a host tier and NVMe in the scratch folder.
 */
static void Config(char* out, size_t capacity) {
  snprintf(out, capacity,
           "{\"zero_optimization\": {\"stage\": 3, \"offload_param\": {\"device\": \"nvme\", "
           "\"nvme_path\": \"%s\", \"buffer_count\": 2, \"buffer_size\": 65536}},"
           " \"strata\": {\"device\": \"emulated\", \"device_budget_bytes\": 131072,"
           " \"host_budget_bytes\": 1048576, \"nvme_capacity_bytes\": 16777216,"
           " \"nvme_keep_files\": true}}",
           scratch);
}

static strata_partition_desc Desc(uint64_t id) {
  strata_partition_desc d;
  memset(&d, 0, sizeof(d));
  d.id = id;
  d.role = STRATA_ROLE_PARAM;
  d.dtype = STRATA_DTYPE_F32;
  d.elements = kBytes / 4;
  d.bytes = kBytes;
  d.group = (int)id;
  return d;
}

static void Pattern(unsigned char* p, unsigned seed) {
  for (size_t i = 0; i < kBytes; ++i) p[i] = (unsigned char)(i * 31u + seed);
}

static int warnings_told = 0;
static void CountWarning(const char* message, void* user) {
  (void)message;
  ++*(int*)user;
}

static strata_runtime* Make(void) {
  char config[1024];
  Config(config, sizeof(config));
  strata_runtime_options options;
  strata_runtime_options_init(&options);
  options.on_warning = CountWarning;
  options.user = &warnings_told;
  strata_runtime* rt = NULL;
  EXPECT_CODE(strata_runtime_create(config, &options, &rt), STRATA_OK);
  EXPECT(rt != NULL);
  return rt;
}

static void TestCodesAndVersion(void) {
  EXPECT(strata_c_api_version() == STRATA_C_API_VERSION);
  EXPECT(strcmp(strata_code_name(STRATA_OK), "OK") == 0);
  EXPECT(strcmp(strata_code_name(STRATA_RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED") == 0);
  EXPECT(strcmp(strata_code_name(STRATA_UNAUTHENTICATED), "UNAUTHENTICATED") == 0);
  EXPECT(strcmp(strata_code_name(17), "UNKNOWN_CODE") == 0);
  EXPECT(strcmp(strata_code_name(-1), "UNKNOWN_CODE") == 0);
  EXPECT(strcmp(strata_last_error_message(), "") == 0);
  EXPECT(strata_last_errno() == 0);
}

static void TestBadConfigsAreRefusedWithTheirReason(void) {
  strata_runtime* rt = (strata_runtime*)&rt; /* not NULL: a failed create must set it NULL */
  EXPECT_CODE(strata_runtime_create("{\"zero_optimization\": {\"stage\": 3,}", NULL, &rt),
              STRATA_INVALID_ARGUMENT);
  EXPECT(rt == NULL);
  EXPECT_MESSAGE_HAS("line 1");

  EXPECT_CODE(strata_runtime_create("{\"zero_optimisation\": {\"stage\": 3}}", NULL, &rt),
              STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("zero_optimisation");
  EXPECT_MESSAGE_HAS("zero_optimization");

  EXPECT_CODE(strata_runtime_create("{\"strata\": {\"device_budget_bytes\": -5}}", NULL, &rt),
              STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("device_budget_bytes");

  EXPECT_CODE(strata_runtime_create(NULL, NULL, &rt), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("config_json is NULL");
  EXPECT_CODE(strata_runtime_create("{}", NULL, NULL), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("out is NULL");

  strata_runtime_options options;
  strata_runtime_options_init(&options);
  options.workers = 0;
  EXPECT_CODE(strata_runtime_create("{}", &options, &rt), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("options.workers is 0");

  char missing[512];
  snprintf(missing, sizeof(missing), "%s/no-such-config.json", scratch);
  EXPECT_CODE(strata_runtime_create_from_file(missing, NULL, &rt), STRATA_NOT_FOUND);
  EXPECT(strata_last_errno() == ENOENT);
  EXPECT_MESSAGE_HAS("no-such-config.json");
  EXPECT(rt == NULL);
}

static void TestConfigFromAFile(void) {
  char config[1024], path[512];
  Config(config, sizeof(config));
  snprintf(path, sizeof(path), "%s/ds_config.json", scratch);
  FILE* f = fopen(path, "w");
  EXPECT(f != NULL);
  if (f == NULL) return;
  fputs(config, f);
  fclose(f);
  strata_runtime* rt = NULL;
  EXPECT_CODE(strata_runtime_create_from_file(path, NULL, &rt), STRATA_OK);
  EXPECT(rt != NULL);
  size_t count = 0;
  EXPECT_CODE(strata_warning_count(rt, &count), STRATA_OK);
  EXPECT(count >= 1); /* the emulated device is announced */
  strata_runtime_destroy(rt);
}

static void TestBytesRoundTripThroughEveryTier(void) {
  strata_runtime* rt = Make();
  if (rt == NULL) return;
  EXPECT(warnings_told >= 1); /* through the callback */
  unsigned char first[kBytes], got[kBytes];
  Pattern(first, 7);
  strata_partition_desc d1 = Desc(1), d2 = Desc(2), d3 = Desc(3);
  EXPECT_CODE(strata_register(rt, &d1, STRATA_TIER_DEVICE, first, kBytes), STRATA_OK);
  EXPECT_CODE(strata_register(rt, &d2, STRATA_TIER_NVME, first, kBytes), STRATA_OK);
  EXPECT_CODE(strata_register(rt, &d3, STRATA_TIER_HOST, NULL, 0), STRATA_OK);
  EXPECT_CODE(strata_register(rt, &d1, STRATA_TIER_HOST, NULL, 0), STRATA_ALREADY_EXISTS);

  /* Device: read, change, release dirty; evicted to the host and read back there. */
  void* p = NULL;
  EXPECT_CODE(strata_acquire(rt, 1, STRATA_TIER_DEVICE, &p), STRATA_OK);
  EXPECT(p != NULL && memcmp(p, first, kBytes) == 0);
  if (p != NULL) memset(p, 0x5a, kBytes);
  EXPECT_CODE(strata_release(rt, 1, STRATA_TIER_DEVICE, 1, NULL), STRATA_OK);
  EXPECT_CODE(strata_evict(rt, 1, STRATA_TIER_DEVICE), STRATA_OK);
  EXPECT_CODE(strata_acquire(rt, 1, STRATA_TIER_HOST, &p), STRATA_OK);
  memset(got, 0x5a, kBytes);
  EXPECT(p != NULL && memcmp(p, got, kBytes) == 0);
  EXPECT_CODE(strata_release(rt, 1, STRATA_TIER_HOST, 0, NULL), STRATA_OK);

  /* NVMe -> device, staged; dropped (clean) and prefetched back, waited for: a prefetch hit. */
  EXPECT_CODE(strata_acquire(rt, 2, STRATA_TIER_DEVICE, &p), STRATA_OK);
  EXPECT(p != NULL && memcmp(p, first, kBytes) == 0);
  EXPECT_CODE(strata_release(rt, 2, STRATA_TIER_DEVICE, 0, NULL), STRATA_OK);
  EXPECT_CODE(strata_evict(rt, 2, STRATA_TIER_DEVICE), STRATA_OK);
  EXPECT_CODE(strata_prefetch(rt, 2, STRATA_TIER_DEVICE, 1), STRATA_OK);
  EXPECT_CODE(strata_acquire(rt, 2, STRATA_TIER_DEVICE, &p), STRATA_OK);
  EXPECT(p != NULL && memcmp(p, first, kBytes) == 0);
  EXPECT_CODE(strata_release(rt, 2, STRATA_TIER_DEVICE, 0, NULL), STRATA_OK);
  /* A partition registered as zeros. */
  EXPECT_CODE(strata_acquire(rt, 3, STRATA_TIER_HOST, &p), STRATA_OK);
  memset(got, 0, kBytes);
  EXPECT(p != NULL && memcmp(p, got, kBytes) == 0);
  EXPECT_CODE(strata_release(rt, 3, STRATA_TIER_HOST, 0, NULL), STRATA_OK);

  /* Discard: the next acquire gets zeros. */
  EXPECT_CODE(strata_discard(rt, 2), STRATA_OK);
  EXPECT_CODE(strata_acquire(rt, 2, STRATA_TIER_HOST, &p), STRATA_OK);
  EXPECT(p != NULL && memcmp(p, got, kBytes) == 0);
  EXPECT_CODE(strata_release(rt, 2, STRATA_TIER_HOST, 0, NULL), STRATA_OK);

  strata_step_report report;
  EXPECT_CODE(strata_end_step(rt, &report), STRATA_OK);
  EXPECT(report.step == 1);
  EXPECT(strcmp(report.mode, "recorded") == 0);
  EXPECT(report.acquires == 6);
  EXPECT(report.hits + report.zero_fills + report.late_prefetches + report.misses ==
         report.acquires);
  EXPECT(report.prefetch_hits == 1);
  EXPECT(report.diverged == 0);
  EXPECT(report.bytes_moved[STRATA_TIER_NVME][STRATA_TIER_DEVICE] +
             report.bytes_moved[STRATA_TIER_NVME][STRATA_TIER_HOST] >=
         kBytes);

  strata_stats stats;
  EXPECT_CODE(strata_get_stats(rt, &stats), STRATA_OK);
  EXPECT(stats.acquires == 6);
  EXPECT(stats.steps == 1);
  EXPECT(stats.host_held_bytes > 0 && stats.host_held_bytes <= 1048576);

  /* The report's JSON: whole, and cut short with its whole length told. */
  char json[2048], small[8];
  size_t length = 0, short_length = 0;
  EXPECT_CODE(strata_last_step_report_json(rt, json, sizeof(json), &length), STRATA_OK);
  EXPECT(length == strlen(json));
  EXPECT(strstr(json, "\"step\":1") != NULL);
  EXPECT_CODE(strata_last_step_report_json(rt, small, sizeof(small), &short_length), STRATA_OK);
  EXPECT(short_length == length && strlen(small) == sizeof(small) - 1);
  EXPECT(strncmp(small, json, sizeof(small) - 1) == 0);
  EXPECT_CODE(strata_last_step_report_json(rt, NULL, 0, &short_length), STRATA_OK);
  EXPECT(short_length == length);
  strata_runtime_destroy(rt);
}

static void TestBadArgumentsNameWhatIsWrong(void) {
  strata_runtime* rt = Make();
  if (rt == NULL) return;
  strata_partition_desc d = Desc(1);
  void* p = (void*)&d;
  EXPECT_CODE(strata_register(NULL, &d, STRATA_TIER_HOST, NULL, 0), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("runtime handle is NULL");
  EXPECT_CODE(strata_register(rt, NULL, STRATA_TIER_HOST, NULL, 0), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("desc is NULL");
  EXPECT_CODE(strata_register(rt, &d, (strata_tier)7, NULL, 0), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("tier 7");
  d.role = (strata_role)9;
  EXPECT_CODE(strata_register(rt, &d, STRATA_TIER_HOST, NULL, 0), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("desc.role 9");
  d = Desc(1);
  d.dtype = (strata_dtype)-2;
  EXPECT_CODE(strata_register(rt, &d, STRATA_TIER_HOST, NULL, 0), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("desc.dtype -2");
  d = Desc(1);
  unsigned char bytes[16] = {0};
  EXPECT_CODE(strata_register(rt, &d, STRATA_TIER_HOST, bytes, sizeof(bytes)),
              STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("initial_bytes is 16");
  EXPECT_CODE(strata_register(rt, &d, STRATA_TIER_HOST, NULL, 5), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("initial is NULL");
  d.bytes = 0;
  EXPECT(strata_register(rt, &d, STRATA_TIER_HOST, NULL, 0) != STRATA_OK);
  d.bytes = 2 * 1048576; /* more than the host budget */
  EXPECT_CODE(strata_register(rt, &d, STRATA_TIER_HOST, NULL, 0), STRATA_RESOURCE_EXHAUSTED);

  EXPECT_CODE(strata_acquire(rt, 42, STRATA_TIER_HOST, &p), STRATA_NOT_FOUND);
  EXPECT_MESSAGE_HAS("42");
  EXPECT(p == NULL);
  EXPECT_CODE(strata_acquire(rt, 42, STRATA_TIER_NVME, &p), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("tier 2 is not accepted here");
  EXPECT_CODE(strata_acquire(rt, 42, STRATA_TIER_HOST, NULL), STRATA_INVALID_ARGUMENT);
  EXPECT_MESSAGE_HAS("address is NULL");
  EXPECT_CODE(strata_release(rt, 42, STRATA_TIER_HOST, 0, NULL), STRATA_NOT_FOUND);
  EXPECT_CODE(strata_prefetch(rt, 42, STRATA_TIER_HOST, 1), STRATA_NOT_FOUND);
  EXPECT_CODE(strata_discard(rt, 42), STRATA_NOT_FOUND);
  EXPECT_CODE(strata_evict(rt, 42, STRATA_TIER_HOST), STRATA_NOT_FOUND);
  EXPECT_CODE(strata_get_stats(rt, NULL), STRATA_INVALID_ARGUMENT);
  EXPECT_CODE(strata_last_step_report_json(rt, NULL, 0, NULL), STRATA_NOT_FOUND);
  EXPECT_MESSAGE_HAS("no step has ended");
  char buffer[8];
  EXPECT_CODE(strata_warning(rt, 1000, buffer, sizeof(buffer), NULL), STRATA_OUT_OF_RANGE);
  EXPECT_MESSAGE_HAS("index 1000");
  EXPECT_CODE(strata_last_step_report_json(rt, NULL, 4, NULL), STRATA_INVALID_ARGUMENT);
  strata_runtime_destroy(rt);
  strata_runtime_destroy(NULL);
}

/* A failing call on one thread leaves another thread's last error as it was. */
static void* FailOnAnotherThread(void* arg) {
  (void)arg;
  strata_acquire(NULL, 1, STRATA_TIER_HOST, NULL);
  return strstr(strata_last_error_message(), "runtime handle is NULL") != NULL ? arg : NULL;
}

static void TestTheLastErrorIsThePerThread(void) {
  strata_runtime* rt = Make();
  if (rt == NULL) return;
  void* p = NULL;
  EXPECT_CODE(strata_acquire(rt, 77, STRATA_TIER_HOST, &p), STRATA_NOT_FOUND);
  pthread_t thread;
  void* result = NULL;
  int token = 0;
  EXPECT(pthread_create(&thread, NULL, FailOnAnotherThread, &token) == 0);
  EXPECT(pthread_join(thread, &result) == 0);
  EXPECT(result == &token);
  EXPECT_MESSAGE_HAS("partition 77");
  strata_runtime_destroy(rt);
}

/* With nvme_keep_files, the store outlives the runtime: flushed, destroyed, made again; a second
 * runtime on the same folder meanwhile is refused. */
static void TestARestartAdoptsWhatWasFlushed(void) {
  unsigned char first[kBytes];
  Pattern(first, 11);
  strata_runtime* rt = Make();
  if (rt == NULL) return;
  strata_partition_desc d = Desc(5);
  EXPECT_CODE(strata_register(rt, &d, STRATA_TIER_HOST, first, kBytes), STRATA_OK);
  EXPECT_CODE(strata_flush(rt), STRATA_OK);

  char config[1024];
  Config(config, sizeof(config));
  strata_runtime* second = NULL;
  EXPECT(strata_runtime_create(config, NULL, &second) != STRATA_OK);
  EXPECT(second == NULL);
  strata_runtime_destroy(rt);

  rt = Make();
  if (rt == NULL) return;
  uint64_t ids[4] = {0};
  size_t count = 0;
  EXPECT_CODE(strata_stored_partitions(rt, ids, 4, &count), STRATA_OK);
  EXPECT(count == 1 && ids[0] == 5);
  EXPECT_CODE(strata_register(rt, &d, STRATA_TIER_HOST, NULL, 0), STRATA_ALREADY_EXISTS);
  EXPECT_CODE(strata_adopt(rt, &d), STRATA_OK);
  void* p = NULL;
  EXPECT_CODE(strata_acquire(rt, 5, STRATA_TIER_HOST, &p), STRATA_OK);
  EXPECT(p != NULL && memcmp(p, first, kBytes) == 0);
  EXPECT_CODE(strata_release(rt, 5, STRATA_TIER_HOST, 0, NULL), STRATA_OK);
  EXPECT_CODE(strata_unregister(rt, 5), STRATA_OK);
  EXPECT_CODE(strata_stored_partitions(rt, NULL, 0, &count), STRATA_OK);
  EXPECT(count == 0);
  strata_runtime_destroy(rt);
}

int main(int argc, char** argv) {
  static const struct {
    const char* name;
    void (*run)(void);
  } kCases[] = {
      {"CodesAndVersion", TestCodesAndVersion},
      {"BadConfigsAreRefusedWithTheirReason", TestBadConfigsAreRefusedWithTheirReason},
      {"ConfigFromAFile", TestConfigFromAFile},
      {"BytesRoundTripThroughEveryTier", TestBytesRoundTripThroughEveryTier},
      {"BadArgumentsNameWhatIsWrong", TestBadArgumentsNameWhatIsWrong},
      {"TheLastErrorIsPerThread", TestTheLastErrorIsThePerThread},
      {"ARestartAdoptsWhatWasFlushed", TestARestartAdoptsWhatWasFlushed},
  };
  const size_t n = sizeof(kCases) / sizeof(kCases[0]);
  if (argc != 2) {
    fprintf(stderr, "usage: %s <case>; cases:", argv[0]);
    for (size_t i = 0; i < n; ++i) fprintf(stderr, " %s", kCases[i].name);
    fprintf(stderr, "\n");
    return 2;
  }
  for (size_t i = 0; i < n; ++i) {
    if (strcmp(argv[1], kCases[i].name) != 0) continue;
    MakeScratch();
    kCases[i].run();
    RemoveScratch();
    printf("%s: %s (%d failure%s)\n", kCases[i].name, failures == 0 ? "passed" : "FAILED", failures,
           failures == 1 ? "" : "s");
    return failures == 0 ? 0 : 1;
  }
  fprintf(stderr, "no case named %s\n", argv[1]);
  return 2;
}
