/* A C program on the installed C API: a runtime made and destroyed, a bad config refused. */
#include <stdio.h>
#include <string.h>

#include "strata/c_api.h"

int main(void) {
  strata_runtime* rt = NULL;
  if (strata_runtime_create("{\"zero_optimisation\": {}}", NULL, &rt) != STRATA_INVALID_ARGUMENT ||
      strstr(strata_last_error_message(), "zero_optimization") == NULL) {
    fprintf(stderr, "a misspelt key was not refused: %s\n", strata_last_error_message());
    return 1;
  }
  int code = strata_runtime_create("{\"strata\": {\"device\": \"emulated\"}}", NULL, &rt);
  if (code != STRATA_OK) {
    fprintf(stderr, "create: %s: %s\n", strata_code_name(code), strata_last_error_message());
    return 1;
  }
  strata_runtime_destroy(rt);
  printf("C API %d: a runtime made and destroyed\n", strata_c_api_version());
  return 0;
}
