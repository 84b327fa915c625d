# cmake -DBUILD_DIR=... -P check_isolation.cmake: builds the two probes of this folder.
function(build target result output)
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${target}
                  RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE out)
  set(${result} ${code} PARENT_SCOPE)
  set(${output} "${out}" PARENT_SCOPE)
endfunction()

build(server_api_probe api_code api_out)
if(NOT api_code EQUAL 0)
  message(FATAL_ERROR "engine/engine.h does not compile as a server file:\n${api_out}")
endif()
build(server_internal_probe internal_code internal_out)
if(internal_code EQUAL 0)
  message(FATAL_ERROR "a server file that includes engine/job/trainer.h compiled: server/'s "
                      "include path reaches the engine's internals")
endif()
if(NOT internal_out MATCHES "engine/job/trainer.h: No such file")
  message(FATAL_ERROR "the internal probe failed, but not for want of the header:\n${internal_out}")
endif()
message(STATUS "server/ reaches engine/engine.h and engine/common/, and no engine internal")
