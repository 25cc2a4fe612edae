// Package check runs Weir's GitOps integrations against the real libraries their tools use:
// the Argo CD health check (../argocd/weir.dev/StreamJob/health.lua) in gopher-lua, the Lua 5.1
// interpreter Argo CD embeds, with Argo CD's test cases (health_test.yaml); and kstatus
// (sigs.k8s.io/cli-utils/pkg/kstatus), which Flux's health checks use, on the same StreamJobs.
// Run by .ci/run through .ci/gitops.sh: `go test ./...` in this directory.
package check

import (
	"os"
	"path/filepath"
	"testing"

	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/yaml"
)

const argoDir = "../argocd/weir.dev/StreamJob"

type healthTests struct {
	Tests []struct {
		InputPath    string `json:"inputPath"`
		HealthStatus struct {
			Status  string `json:"status"`
			Message string `json:"message"`
		} `json:"healthStatus"`
	} `json:"tests"`
}

type kstatusTests struct {
	Tests []struct {
		InputPath string `json:"inputPath"`
		Status    string `json:"status"`
	} `json:"tests"`
}

func readYAML(t *testing.T, path string, into any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	if err := yaml.Unmarshal(data, into); err != nil {
		t.Fatalf("parsing %s: %v", path, err)
	}
}

// toLua converts a decoded JSON value to Lua as Argo CD does: objects and arrays become tables
// (arrays 1-based), numbers LNumber, strings, booleans, null nil.
func toLua(l *lua.LState, v any) lua.LValue {
	switch x := v.(type) {
	case map[string]any:
		t := l.NewTable()
		for k, e := range x {
			t.RawSetString(k, toLua(l, e))
		}
		return t
	case []any:
		t := l.NewTable()
		for _, e := range x {
			t.Append(toLua(l, e))
		}
		return t
	case string:
		return lua.LString(x)
	case bool:
		return lua.LBool(x)
	case float64:
		return lua.LNumber(x)
	case int64:
		return lua.LNumber(x)
	case nil:
		return lua.LNil
	default:
		panic("unexpected JSON value")
	}
}

// health runs health.lua on obj in a fresh interpreter with only the libraries Argo CD opens.
func health(t *testing.T, script string, obj map[string]any) (string, string) {
	t.Helper()
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for _, lib := range []struct {
		name string
		fn   lua.LGFunction
	}{{lua.LoadLibName, lua.OpenPackage}, {lua.BaseLibName, lua.OpenBase}, {lua.TabLibName, lua.OpenTable},
		{lua.StringLibName, lua.OpenString}, {lua.MathLibName, lua.OpenMath}} {
		l.Push(l.NewFunction(lib.fn))
		l.Push(lua.LString(lib.name))
		l.Call(1, 0)
	}
	l.SetGlobal("obj", toLua(l, obj))
	if err := l.DoString(script); err != nil {
		t.Fatalf("health.lua failed: %v", err)
	}
	ret, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		t.Fatalf("health.lua returned %s, not a table", l.Get(-1).Type())
	}
	return ret.RawGetString("status").String(), ret.RawGetString("message").String()
}

// object reads a StreamJob as the API server would serve it (integers as int64).
func object(t *testing.T, path string) map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		t.Fatalf("parsing %s: %v", path, err)
	}
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(js); err != nil {
		t.Fatalf("decoding %s: %v", path, err)
	}
	if u.GetKind() != "StreamJob" {
		t.Fatalf("%s is not a StreamJob", path)
	}
	return u.Object
}

func TestArgoCDHealthCheck(t *testing.T) {
	script, err := os.ReadFile(filepath.Join(argoDir, "health.lua"))
	if err != nil {
		t.Fatal(err)
	}
	var cases healthTests
	readYAML(t, filepath.Join(argoDir, "health_test.yaml"), &cases)
	if len(cases.Tests) < 10 {
		t.Fatalf("only %d cases in health_test.yaml", len(cases.Tests))
	}
	covered := map[string]bool{}
	for _, c := range cases.Tests {
		obj := object(t, filepath.Join(argoDir, c.InputPath))
		st, msg := health(t, string(script), obj)
		covered[st] = true
		if st != c.HealthStatus.Status || msg != c.HealthStatus.Message {
			t.Errorf("%s: health %q %q, want %q %q", c.InputPath, st, msg, c.HealthStatus.Status, c.HealthStatus.Message)
		}
	}
	for _, want := range []string{"Healthy", "Progressing", "Degraded", "Suspended"} {
		if !covered[want] {
			t.Errorf("no case is %s", want)
		}
	}
	// Every fixture the operator's status code produced has a case.
	files, _ := filepath.Glob(filepath.Join(argoDir, "testdata", "*.yaml"))
	if len(files) != len(cases.Tests) {
		t.Errorf("%d fixtures in testdata but %d cases", len(files), len(cases.Tests))
	}
}

func TestKstatus(t *testing.T) {
	var cases kstatusTests
	readYAML(t, "../flux/kstatus_test.yaml", &cases)
	if len(cases.Tests) < 10 {
		t.Fatalf("only %d cases in kstatus_test.yaml", len(cases.Tests))
	}
	for _, c := range cases.Tests {
		u := &unstructured.Unstructured{Object: object(t, filepath.Join("../flux", c.InputPath))}
		res, err := status.Compute(u)
		if err != nil {
			t.Fatalf("%s: kstatus: %v", c.InputPath, err)
		}
		if string(res.Status) != c.Status {
			t.Errorf("%s: kstatus %s (%s), want %s", c.InputPath, res.Status, res.Message, c.Status)
		}
	}
}
