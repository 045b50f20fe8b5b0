{{/*
One worker role (prefill or decode): its Deployment, headless Service and PodDisruptionBudget.
Called as (dict "root" $ "component" "prefill").
*/}}

{{/* The worker's command line after `pdserve`. $(POD_IP) is expanded by the kubelet from the env below. */}}
{{- define "pdserve.workerArgs" -}}
{{- $v := .root.Values -}}
{{- $w := index $v .component -}}
{{- $args := list "--log-level" $v.logLevel .component
      "--host" "0.0.0.0" "--port" (toString $w.port) "--metrics-port" (toString $w.metricsPort)
      "--advertise-host" "$(POD_IP)" "--drain-timeout-s" (toString $w.drainTimeoutSeconds)
      "--tp" (toString $w.tp) "--device" (ternary "cuda" "cpu" $v.gpu.enabled) "--dtype" $v.engine.dtype -}}
{{- with include "pdserve.modelArg" .root -}}
{{- $args = concat $args (list "--model" .) -}}
{{- end -}}
{{- $order := $v.engine.kvBlockOrder -}}
{{- if and (not $order) $v.prefill.enabled (ne (int $v.prefill.tp) (int $v.decode.tp)) -}}
{{- $order = "HND" -}}
{{- end -}}
{{- if $order -}}
{{- $args = concat $args (list "--kv-block-order" $order) -}}
{{- end -}}
{{- $args = concat $args $v.engine.extraArgs $w.extraArgs -}}
{{- toYaml $args -}}
{{- end -}}

{{/*
The worker's preStop hook: `pdserve drain` on its own gRPC port (the cluster token comes from the container's
env). It lets the worker serve on for preStopSleepSeconds, drains it and waits until it is drained, giving up
when the pod's grace period would be over anyway.
*/}}
{{- define "pdserve.workerPreStop" -}}
{{- $v := .root.Values -}}
{{- $w := index $v .component -}}
{{- toYaml (list "pdserve" "drain" "--port" (toString $w.port) "--after-s" (toString $w.preStopSleepSeconds)
      "--timeout-s" (toString (add $w.drainTimeoutSeconds $v.terminationMarginSeconds))) -}}
{{- end -}}

{{- define "pdserve.worker" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $w := index $v .component -}}
{{- $name := include "pdserve.componentName" . -}}
{{- $gpus := ternary $w.tp $w.gpus (kindIs "invalid" $w.gpus) -}}
{{- $resources := deepCopy $w.resources -}}
{{- if $v.gpu.enabled -}}
{{- $limits := default dict $resources.limits -}}
{{- $_ := set $limits $v.gpu.resourceName (int $gpus) -}}
{{- $_ = set $resources "limits" $limits -}}
{{- end -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.componentLabels" . | nindent 4 }}
spec:
  # Headless: the name resolves to every ready worker's pod IP, which is what the router dials.
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "pdserve.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $w.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $w.metricsPort }}
      targetPort: metrics
      protocol: TCP
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "pdserve.componentLabels" . | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $w.replicas }}
  {{- end }}
  strategy:
    {{- toYaml $w.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.componentLabels" . | nindent 8 }}
        {{- with $w.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $w.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "pdserve.podCommon" . | nindent 6 }}
      {{- if and $v.gpu.enabled $v.gpu.runtimeClassName }}
      runtimeClassName: {{ $v.gpu.runtimeClassName }}
      {{- end }}
      # The preStop hook: serving on (routers stop sending it work), then the drain (--drain-timeout-s); a margin
      # for the requests a decode drain migrates to end and to close the engine and its TP ranks.
      terminationGracePeriodSeconds: {{ add $w.preStopSleepSeconds $w.drainTimeoutSeconds $v.terminationMarginSeconds }}
      {{- with (include "pdserve.modelInitContainers" $root | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "pdserve.image" (dict "root" $root "component" .component "gpu" $v.gpu.enabled) | quote }}
          imagePullPolicy: {{ include "pdserve.imagePullPolicy" . }}
          command: ["pdserve"]
          args:
            {{- include "pdserve.workerArgs" . | nindent 12 }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: HOME
              value: /tmp
            {{- if $v.kvAuth.enabled }}
            - name: PDSERVE_KV_AUTH_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ include "pdserve.kvAuthSecretName" $root }}
                  key: {{ include "pdserve.kvAuthSecretKey" $root }}
            {{- end }}
            {{- include "pdserve.tlsEnv" $root | nindent 12 }}
            {{- with $w.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $w.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $w.metricsPort }}
              protocol: TCP
          startupProbe:
            {{- include "pdserve.workerProbe" (dict "root" $root "port" $w.port) | nindent 12 }}
            {{- include "pdserve.probeTiming" $w.probes.startup | nindent 12 }}
          readinessProbe:
            {{- include "pdserve.workerProbe" (dict "root" $root "port" $w.port) | nindent 12 }}
            {{- include "pdserve.probeTiming" $w.probes.readiness | nindent 12 }}
          livenessProbe:
            {{- include "pdserve.workerProbe" (dict "root" $root "port" $w.port) | nindent 12 }}
            {{- include "pdserve.probeTiming" $w.probes.liveness | nindent 12 }}
          # Serve on while the routers drop the terminating pod (out of the headless Service at once, out of
          # their table at their next DNS refresh), then drain and wait until drained: a prefill worker until its
          # tickets are pulled, released or expired, a decode worker until its requests finish or, past
          # drainTimeoutSeconds, move to another decode worker. The SIGTERM that follows stops it at once.
          lifecycle:
            preStop:
              exec:
                command:
                  {{- include "pdserve.workerPreStop" . | nindent 18 }}
          {{- with $resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- include "pdserve.containerSecurityContext" . | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: dshm
              mountPath: /dev/shm
            {{- with (include "pdserve.modelMount" $root | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- include "pdserve.tlsMount" $root | nindent 12 }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $v.tmpSizeLimit }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSizeLimit }}
        {{- with (include "pdserve.modelVolume" $root | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- include "pdserve.tlsVolume" $root | nindent 8 }}
{{- include "pdserve.pdb" . }}
{{- end -}}
