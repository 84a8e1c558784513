# Finds uring and defines LibUring::LibUring.
include(${CMAKE_CURRENT_LIST_DIR}/StrataFindSimple.cmake)
strata_find_simple(LibUring liburing.h uring)
