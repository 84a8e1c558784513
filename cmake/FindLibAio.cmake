# Finds aio and defines LibAio::LibAio.
include(${CMAKE_CURRENT_LIST_DIR}/StrataFindSimple.cmake)
strata_find_simple(LibAio libaio.h aio)
