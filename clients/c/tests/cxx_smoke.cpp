// The public header compiles as C++ and links (extern "C"); no daemon needed.
#include "moecache.h"
#include <cstdio>
#include <cstring>

int main() {
    mc_options o;
    mc_options_init(&o);
    o.connect_timeout_ms = 200;
    o.heartbeat_thread = 0;
    mc_error e;
    mc_client *c = mc_connect("ipc:///nonexistent/moecache-cxx-smoke.sock", "cxx", &o, &e);
    // no socket file: refused at once (no wait for the connect timeout)
    if (c != nullptr || e.code != MC_ERR_SYSTEM || std::strstr(e.message, "no daemon socket at") == nullptr) {
        std::fprintf(stderr, "unexpected: %p %s %s\n", (void *)c, mc_code_name(e.code), e.message);
        return 1;
    }
    std::printf("cxx_smoke: ok (%s)\n", e.message);
    return 0;
}
