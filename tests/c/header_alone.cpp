/* The header compiles alone (and twice) as C++17 with -Wall -Wextra -Wpedantic -Werror. */
#include "kvxfer.h"
#include "kvxfer.h"

int main(void) { return kvx_abi_version() == 0; }
