# Script mode: install, then build and run the consumer, and link every object of every installed
# archive into a shared object with nothing left undefined, through find_package and pkg-config.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(LAST_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
file(GLOB archives ${prefix}/${LIBDIR}/libstrata_*.a)
list(LENGTH archives count)
if(NOT count EQUAL 7)
  message(FATAL_ERROR "expected the seven strata archives in ${prefix}/${LIBDIR}, found: ${archives}")
endif()

# CMake package (builds the consumer and the whole-archive shared object).
run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/consumer -B ${WORK_DIR}/build -DCMAKE_PREFIX_PATH=${prefix}
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
message(STATUS "find_package consumer: ${LAST_OUTPUT}")
run(${WORK_DIR}/build/c_consumer)
message(STATUS "find_package C consumer: ${LAST_OUTPUT}")

# pkg-config, as docs/c-api.md says (the dependencies of the static libraries are public), and with
# --static too.
set(ENV{PKG_CONFIG_PATH} "${prefix}/${LIBDIR}/pkgconfig")
foreach(mode plain static)
  if(mode STREQUAL "static")
    run(pkg-config --cflags --libs --static strata)
  else()
    run(pkg-config --cflags --libs strata)
  endif()
  string(STRIP "${LAST_OUTPUT}" flags)
  separate_arguments(flags UNIX_COMMAND "${flags}")
  run(${CXX} -std=c++20 ${SOURCE_DIR}/consumer/main.cc -o ${WORK_DIR}/consumer_pc_${mode} ${flags})
  run(${WORK_DIR}/consumer_pc_${mode})
  message(STATUS "pkg-config (${mode}) consumer: ${LAST_OUTPUT}")
  run(${CXX} -std=c++20 -fPIC -shared ${SOURCE_DIR}/consumer/main.cc
      -o ${WORK_DIR}/libwhole_archive_pc_${mode}.so -Wl,--no-undefined
      -Wl,--whole-archive ${archives} -Wl,--no-whole-archive ${flags})
  message(STATUS "pkg-config (${mode}): every object of the archives links")
endforeach()
