// Command etcd is etcd's own server entry point, built from the go.etcd.io/etcd/server/v3
// module at the version pinned in ../go.mod.
//
// etcd's upstream main package lives in the root module go.etcd.io/etcd/v3, whose go.mod
// replaces its sibling modules with relative paths; such a module cannot be required from
// another one. etcdmain.Main is exactly what that main package calls, so this file is the
// same program.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
