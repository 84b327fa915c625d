# cmake -DDIR=<folder> -P fresh_dir.cmake: <folder> exists and is empty.
if(NOT DIR)
  message(FATAL_ERROR "fresh_dir.cmake: pass -DDIR=<folder>")
endif()
file(REMOVE_RECURSE "${DIR}")
file(MAKE_DIRECTORY "${DIR}")
