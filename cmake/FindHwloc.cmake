# Finds hwloc and defines Hwloc::Hwloc.
include(${CMAKE_CURRENT_LIST_DIR}/StrataFindSimple.cmake)
strata_find_simple(Hwloc hwloc.h hwloc)
