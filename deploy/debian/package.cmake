# The Debian package of the daemon: `deploy/package.sh deb` (or `cpack -G DEB` in a build tree)
# makes kvcellard_<version>_amd64.deb with
#   /usr/bin/kvcellard, /usr/bin/kvcellarctl
#   /lib/systemd/system/kvcellard.service   (deploy/systemd/kvcellard.service, binaries in /usr/bin)
#   /etc/kvcellar/kvcellard.yaml            (config/kvcellard.yaml; a conffile: kept on remove,
#                                             removed on purge)
#   /usr/share/doc/kvcellard/copyright
# and maintainer scripts (deploy/debian/postinst, postrm) that make the `kvcellar` system user
# and group and hand the unit to systemd where it runs. The runtime dependencies are computed by
# dpkg-shlibdeps from the binaries, so `apt install ./kvcellard_*.deb` pulls exactly the shared
# libraries they link (gRPC, Protobuf, Abseil, OpenSSL, ...).
#
# Only the `daemon` install component goes into the package: nothing of the tests, benchmarks or
# the Python package's library.

# The unit as shipped names /usr/local/bin (a hand install); the package's binaries are in
# /usr/bin, and its first paragraph (how to install it by hand) gives way to the package's own.
file(READ ${CMAKE_SOURCE_DIR}/deploy/systemd/kvcellard.service KVCELLAR_UNIT)
string(FIND "${KVCELLAR_UNIT}" "#\n# The engine socket" KVCELLAR_UNIT_BODY)
if(KVCELLAR_UNIT_BODY LESS 0)
  message(FATAL_ERROR "deploy/systemd/kvcellard.service: no '# The engine socket' paragraph")
endif()
string(SUBSTRING "${KVCELLAR_UNIT}" ${KVCELLAR_UNIT_BODY} -1 KVCELLAR_UNIT)
string(PREPEND KVCELLAR_UNIT "# kvcellard under systemd, installed by the kvcellard Debian package: the \
binaries in\n# /usr/bin, the config in /etc/kvcellar/kvcellard.yaml, the `kvcellar` user and \
group made.\n# Size pool.capacity, then `systemctl start kvcellard`.\n")
string(REPLACE "/usr/local/bin/" "/usr/bin/" KVCELLAR_UNIT "${KVCELLAR_UNIT}")
string(REPLACE "/usr/local/share/doc/kvcellar/" "/usr/share/doc/kvcellard/" KVCELLAR_UNIT
       "${KVCELLAR_UNIT}")
file(WRITE ${CMAKE_BINARY_DIR}/debian/kvcellard.service "${KVCELLAR_UNIT}")
file(WRITE ${CMAKE_BINARY_DIR}/debian/conffiles "/etc/kvcellar/kvcellard.yaml\n")
foreach(script postinst postrm)
  configure_file(${CMAKE_SOURCE_DIR}/deploy/debian/${script} ${CMAKE_BINARY_DIR}/debian/${script}
                 COPYONLY FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ
                 GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endforeach()

# Relative destinations under the packaging prefix "/".
install(TARGETS kvcellard kvcellarctl RUNTIME DESTINATION usr/bin COMPONENT daemon)
install(FILES ${CMAKE_BINARY_DIR}/debian/kvcellard.service DESTINATION lib/systemd/system
        COMPONENT daemon)
install(FILES ${CMAKE_SOURCE_DIR}/config/kvcellard.yaml DESTINATION etc/kvcellar
        PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ COMPONENT daemon)
install(FILES ${CMAKE_SOURCE_DIR}/deploy/debian/copyright DESTINATION usr/share/doc/kvcellard
        COMPONENT daemon)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME kvcellar)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /)
set(CPACK_STRIP_FILES ON)
set(CPACK_COMPONENTS_ALL daemon)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_DAEMON_PACKAGE_NAME kvcellard)
set(CPACK_DEBIAN_DAEMON_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_ARCHITECTURE amd64)
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "kvcellar developers <kvcellar@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "per-node KV-cache daemon for LLM inference")
# The summary line is CPACK_PACKAGE_DESCRIPTION_SUMMARY; this is the text below it.
set(CPACK_DEBIAN_DAEMON_DESCRIPTION
    "kvcellard owns a host-memory pool shared by every inference engine of the node, keeps a
radix index of the cached KV pages, moves pages to and from local NVMe, shared file systems and
Redis, survives its own restart with the pool intact, and publishes KV events for routers.
This package has the daemon, kvcellarctl, the systemd unit and the default configuration.")
set(CPACK_DEBIAN_DAEMON_PACKAGE_SHLIBDEPS ON)
# useradd/groupadd (passwd) make the system user; both are in every Debian base system.
set(CPACK_DEBIAN_DAEMON_PACKAGE_DEPENDS "passwd")
set(CPACK_DEBIAN_DAEMON_PACKAGE_RECOMMENDS "systemd")
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_EXTRA
    "${CMAKE_BINARY_DIR}/debian/conffiles;${CMAKE_BINARY_DIR}/debian/postinst;${CMAKE_BINARY_DIR}/debian/postrm")
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
