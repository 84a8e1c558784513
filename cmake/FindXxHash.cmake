# Finds xxHash and defines XxHash::XxHash.
include(${CMAKE_CURRENT_LIST_DIR}/StrataFindSimple.cmake)
strata_find_simple(XxHash xxhash.h xxhash)
